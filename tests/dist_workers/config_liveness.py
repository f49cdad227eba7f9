"""Worker: which schema keys does the run-time code read? Every read of a config field is recorded.

Runs ``launch.main`` in this process for several scenarios (argv: an output JSON, then scenarios
as ``name|key=value;key=value...``), with each schema dataclass's attribute reads recorded by
instance: a read counts when it does not happen while the config is loaded and checked
(``engine.config.loader``) or written out (OmegaConf). Writes the dotted keys that were read.
"""

import dataclasses
import json
import sys
import typing

LOAD_TIME_MODULES = ("engine/config/loader.py", "/omegaconf/")


def schema_classes(cls, found=None):
    found = found if found is not None else set()
    found.add(cls)
    for name, annotation in typing.get_type_hints(cls).items():
        for candidate in (annotation, *typing.get_args(annotation)):
            if dataclasses.is_dataclass(candidate) and candidate not in found:
                schema_classes(candidate, found)
    return found


def index_instances(config, prefix: str, index: dict) -> None:
    index[id(config)] = prefix
    for field in dataclasses.fields(config):
        value = object.__getattribute__(config, field.name)
        if dataclasses.is_dataclass(value):
            index_instances(value, f"{prefix}{field.name}.", index)


def main() -> None:
    out_file, *scenarios = sys.argv[1:]
    import engine.config
    from engine.config import ExperimentConfig

    index: dict[int, str] = {}
    read: set[str] = set()

    def recording_getattribute(self, name):
        value = object.__getattribute__(self, name)
        prefix = index.get(id(self))
        if prefix is not None and name in object.__getattribute__(self, "__dataclass_fields__"):
            frame = sys._getframe(1)
            while frame is not None:
                if any(part in frame.f_code.co_filename for part in LOAD_TIME_MODULES):
                    return value
                frame = frame.f_back
            read.add(prefix + name)
        return value

    for cls in schema_classes(ExperimentConfig):
        cls.__getattribute__ = recording_getattribute

    load_config = engine.config.load_config

    def indexing_load_config(*args, **kwargs):
        config = load_config(*args, **kwargs)
        index_instances(config, "", index)
        return config

    engine.config.load_config = indexing_load_config  # launch.main's run() imports it from the package

    from launch.main import main as launch_main

    for scenario in scenarios:
        name, _, overrides = scenario.partition("|")
        print(f"[liveness] scenario {name}", flush=True)
        if launch_main(["yaml/demo_cpu.yaml", *[o for o in overrides.split(";") if o]]) != 0:
            raise AssertionError(f"scenario {name} failed")

    with open(out_file, "w") as handle:
        json.dump(sorted(read), handle)


if __name__ == "__main__":
    main()
