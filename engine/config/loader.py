"""Load an experiment: YAML file + ``key=value`` overrides -> checked :class:`ExperimentConfig`.

Steps, each of which turns every OmegaConf/YAML exception into a :class:`ConfigError`:

1. parse the YAML file (syntax errors name the file and line);
2. check every key against the schema before merging, so an unknown key is reported with its full
   dotted name, where it came from and the closest valid key;
3. merge file and overrides, in order, onto the schema defaults (OmegaConf type-checks each value);
4. resolve interpolations and build the dataclasses (``OmegaConf.to_object``);
5. fill derived defaults (``~`` in paths, the tokenizer path) and run the cross-field checks of
   :mod:`engine.config.validation`.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (InterpolationResolutionError, MissingMandatoryValue,
                              OmegaConfBaseException)

from engine.config.actor_rollout_ref import ULYSSES_KEY
from engine.config.errors import ConfigError
from engine.config.experiment import ExperimentConfig

# verl (or older) names users type, and the key that means the same thing here.
RENAMED_KEYS = {
    "actor_rollout_ref.actor.grad_clip": "actor_rollout_ref.actor.optim.max_grad_norm",
    "critic.grad_clip": "critic.optim.max_grad_norm",
    "actor_rollout_ref.actor.ppo_micro_batch_size": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size": "critic.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.response_length": "data.max_response_length",
    "actor_rollout_ref.rollout.prompt_length": "data.max_prompt_length",
    "trainer.critic_warmup": "critic.warmup_steps",
    "actor_rollout_ref.actor.optim.clip_grad": "actor_rollout_ref.actor.optim.max_grad_norm",
    "critic.optim.clip_grad": "critic.optim.max_grad_norm",
}
# Keys verl (or an older Trident) has and this schema does not, and why; naming one is an error that says so.
REMOVED_KEYS = {
    "critic.model.tokenizer_path": "the critic scores the actor's token ids and has no tokenizer of its own",
    "critic.model.trust_remote_code": "the critic is built by megatron from config.json and runs no checkpoint code",
}
# Other spellings of a key, accepted as that key (the seed recipe's names): a file or override may
# use either, not both with different values.
ALIAS_KEYS = {
    "trainer.checkpoint.every_n_steps": "trainer.save_freq",
    # verl prunes the actor's and the critic's checkpoints separately; here one checkpoint (one
    # resume point) holds both, so both keys are the number of checkpoints kept.
    "trainer.max_actor_ckpt_to_keep": "trainer.max_ckpt_to_keep",
    "trainer.max_critic_ckpt_to_keep": "trainer.max_ckpt_to_keep",
}
# Why two spellings must agree, where that is not obvious.
ALIAS_NOTES = {
    "trainer.max_ckpt_to_keep": " A checkpoint holds the actor and the critic together (one resume point), so both "
                                "keep the same number of checkpoints.",
}
# verl's ``strategy`` keys pick a training backend; Megatron is Trident's only one.
STRATEGY_KEYS = ("actor_rollout_ref.actor.strategy", "actor_rollout_ref.ref.strategy", "critic.strategy",
                 "reward_model.strategy")
MEGATRON_STRATEGY = "megatron"
# Keys typed list[str] that also take one string (the way users write a single file).
SINGLE_OR_LIST_KEYS = ("data.train_files", "data.val_files")
# Path keys in which a leading "~" is expanded.
PATH_KEYS = (
    "data.train_files", "data.val_files",
    "actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path", "critic.model.path",
    "reward_model.custom_reward_function.path", "reward_model.model.path", "reward_model.model.tokenizer_path",
    "reward_model.judge.model.path", "trainer.default_local_dir", "trainer.resume_from_path",
)
_OVERRIDE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def load_config(
    yaml_path: str | Path, overrides: Sequence[str] = (), world_size: int | None = None
) -> ExperimentConfig:
    """Load, merge, type-check and validate an experiment.

    Args:
        yaml_path: the experiment file (see ``yaml/``).
        overrides: ``dotted.key=value`` strings applied after the file, in order; values are parsed
            as YAML (``[0.9,0.95]``, ``true``, ``null``).
        world_size: ranks of the job for the parallel-layout checks; None uses
            ``trainer.nnodes * trainer.n_gpus_per_node``.

    Returns:
        Plain dataclass instances (``OmegaConf.to_object``) with every interpolation resolved.

    Raises:
        ConfigError: for any mistake, with a one-paragraph message.
    """
    from engine.config.validation import validate

    path = Path(yaml_path)
    tree, text = _read_yaml(path)
    merged = _merge(_schema(), tree, source=str(path), yaml_text=text)
    for override in overrides:
        merged = _merge(merged, _parse_override(override), source=f"override {override!r}")
    _read_ulysses_as_context_parallel(merged)
    config = _to_object(merged)
    _fill_derived_defaults(config)
    validate(config, world_size)
    return config


def to_yaml(config: ExperimentConfig) -> str:
    """The config as YAML, every value resolved; :func:`load_config` reads it back to an equal config."""
    try:
        return OmegaConf.to_yaml(OmegaConf.structured(config), resolve=True)
    except OmegaConfBaseException as error:
        raise ConfigError(f"cannot write the config as YAML: {_first_line(error)}") from None


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    # Building the node tree from the dataclasses is the slowest step; OmegaConf.merge copies its
    # first argument, so one cached tree serves every load.
    return OmegaConf.structured(ExperimentConfig)


# ----------------------------------------------------------------------------- reading input


def _read_yaml(path: Path) -> tuple[dict[str, Any], str]:
    """The file's mapping (interpolations unresolved) and its text."""
    if not path.is_file():
        siblings = sorted(str(p) for p in path.parent.glob("*.yaml")) if path.parent.is_dir() else []
        hint = f" Files in {path.parent}: {', '.join(siblings)}." if siblings else ""
        raise ConfigError(f"Config file {path} does not exist.{hint}")
    try:
        text = path.read_text()
        loaded = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
        where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
        problem = getattr(error, "problem", None) or str(error)
        lines = text.splitlines()
        if mark and mark.line < len(lines) and "\t" in lines[mark.line][:mark.column + 1]:
            problem = "a tab character; YAML indents with spaces only (replace the tab with spaces)"
        raise ConfigError(f"YAML syntax error in {where}: {problem}.") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"Cannot read config file {path}: {error}.") from None
    except OmegaConfBaseException:  # the document is a bare scalar
        loaded = None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path} must hold a mapping of sections (data:, trainer:, ...).")
    return OmegaConf.to_container(loaded, resolve=False), text


def _parse_override(override: str) -> dict[str, Any]:
    key, equals, value = override.partition("=")
    if key.startswith(("+", "~")):
        raise ConfigError(
            f"Override {override!r}: the Hydra prefixes '+', '++' and '~' are not supported; every key "
            f"already exists in the schema, so write {key.lstrip('+~')}=VALUE."
        )
    if not equals or not _OVERRIDE_KEY.fullmatch(key):
        raise ConfigError(
            f"Override {override!r} is not of the form dotted.key=value "
            "(for example data.train_batch_size=256 or actor_rollout_ref.actor.optim.betas=[0.9,0.95])."
        )
    try:
        # OmegaConf's own value parsing (YAML, with 1e-6 read as a float), as for the file.
        parsed = OmegaConf.from_dotlist([override])
    except (yaml.YAMLError, OmegaConfBaseException) as error:
        raise ConfigError(
            f"Override {override!r}: the value {value!r} is not valid YAML "
            f"({getattr(error, 'problem', None) or _first_line(error)}); quote strings and close lists, "
            "e.g. key=[1,2]."
        ) from None
    return OmegaConf.to_container(parsed, resolve=False)


# ----------------------------------------------------------------------------- merging


def _merge(base: DictConfig, tree: dict[str, Any], source: str, yaml_text: str | None = None) -> DictConfig:
    _normalize(tree, source)
    _check_keys(tree, ExperimentConfig, prefix="", source=source, yaml_text=yaml_text)
    try:
        return OmegaConf.merge(base, tree)
    except OmegaConfBaseException as error:
        raise _type_error(error, source) from None


def _normalize(tree: dict[str, Any], source: str) -> None:
    for dotted in STRATEGY_KEYS:
        value = _pop(tree, dotted)
        if value is not _ABSENT and value != MEGATRON_STRATEGY:
            raise ConfigError(f"{dotted}={value!r} ({source}): Trident's only training backend is Megatron "
                              f"(megatron-core's tensor, pipeline, data and expert parallelism); set it to "
                              f"{MEGATRON_STRATEGY!r} or remove it, and size the layout with "
                              f"{dotted.rpartition('.')[0]}.megatron.*.")
    set_by: dict[str, str] = {}  # which spelling gave a key its value in this tree
    for alias, key in ALIAS_KEYS.items():
        value = _pop(tree, alias)
        if value is _ABSENT:
            continue
        section, _, leaf = key.rpartition(".")
        node = tree.setdefault(section, {}) if "." not in section else None
        if not isinstance(node, dict):
            raise ConfigError(f"{alias} ({source}) is {key}, which must be inside the {section!r} section.")
        if leaf in node and node[leaf] != value:
            raise ConfigError(f"{alias}={value!r} and {set_by.get(key, key)}={node[leaf]!r} ({source}) are the same "
                              f"setting; keep one ({key}).{ALIAS_NOTES.get(key, '')}")
        node[leaf] = value
        set_by[key] = alias
    for dotted in SINGLE_OR_LIST_KEYS:
        section, _, key = dotted.partition(".")
        node = tree.get(section)
        if isinstance(node, dict) and key in node:
            if isinstance(node[key], str):
                node[key] = [node[key]]
            elif node[key] is None and key == "val_files":  # `val_files: null` = no validation set
                node[key] = []


_ABSENT = object()


def _pop(tree: dict[str, Any], dotted: str) -> Any:
    """Remove the key ``dotted`` from the nested ``tree`` and return its value (``_ABSENT`` if it
    is not there); a section left empty by it goes too."""
    head, _, rest = dotted.partition(".")
    if head not in tree:
        return _ABSENT
    if not rest:
        return tree.pop(head)
    node = tree[head]
    if not isinstance(node, dict):
        return _ABSENT
    value = _pop(node, rest)
    if value is not _ABSENT and not node:
        del tree[head]
    return value


def _check_keys(tree: dict, cls: type, prefix: str, source: str, yaml_text: str | None) -> None:
    """Raise on the first key of ``tree`` that ``cls`` lacks; drop empty sections (``critic:`` alone)."""
    fields = schema_fields(cls)
    for raw_key, value in list(tree.items()):
        key = str(raw_key)
        full_key = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(_unknown_key_message(full_key, cls, source, yaml_text))
        section = section_class(fields[key])
        if section is None:
            continue
        if value is None:
            del tree[raw_key]
        elif isinstance(value, Mapping):
            _check_keys(value, section, f"{full_key}.", source, yaml_text)
        else:
            names = ", ".join(schema_fields(section))
            raise ConfigError(
                f"{full_key} is a section, not a value ({_where(full_key, source, yaml_text)} gives "
                f"{value!r}); set its keys instead, e.g. {full_key}.KEY=VALUE with KEY one of: {names}."
            )


def _unknown_key_message(full_key: str, parent: type, source: str, yaml_text: str | None) -> str:
    if full_key in REMOVED_KEYS:
        return (f"Config key '{full_key}' ({_where(full_key, source, yaml_text)}) does not exist here: "
                f"{REMOVED_KEYS[full_key]}. Remove it.")
    parent_key, _, leaf = full_key.rpartition(".")
    valid_here = list(schema_fields(parent))
    suggestion = closest_key(full_key)
    message = f"Unknown config key '{full_key}' ({_where(full_key, source, yaml_text)})."
    if suggestion:
        renamed = " (that is its name here)" if full_key in RENAMED_KEYS else ""
        message += f" Did you mean '{suggestion}'{renamed}?"
    scope = f"under '{parent_key}'" if parent_key else "at the top level"
    message += f" Valid keys {scope}: {', '.join(valid_here)}."
    return message


def closest_key(full_key: str) -> str | None:
    """The valid dotted key a user most likely meant by ``full_key`` (None if nothing is close)."""
    if full_key in RENAMED_KEYS:
        return RENAMED_KEYS[full_key]
    parent_key, _, leaf = full_key.rpartition(".")
    keys = all_keys()
    siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent_key]
    # A typo of a key of the same section first, then the right name in the wrong section.
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.75)
    if close:
        return f"{parent_key}.{close[0]}" if parent_key else close[0]
    same_leaf = [k for k in keys if k.rpartition(".")[2] == leaf]
    if same_leaf:
        return max(same_leaf, key=lambda k: difflib.SequenceMatcher(None, k, full_key).ratio())
    close = difflib.get_close_matches(full_key, keys, n=1, cutoff=0.6)
    return close[0] if close else None


def _where(full_key: str, source: str, yaml_text: str | None) -> str:
    line = _yaml_line(yaml_text, full_key.split(".")) if yaml_text is not None else None
    return f"{source}, line {line}" if line else source


def _yaml_line(yaml_text: str, parts: list[str]) -> int | None:
    """1-based line of the key ``parts`` in ``yaml_text`` (None if it cannot be located)."""
    try:
        node = yaml.compose(yaml_text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    line = None
    for part in parts:
        if not isinstance(node, yaml.MappingNode):
            return line
        for key_node, value_node in node.value:
            if str(key_node.value) == part:
                line, node = key_node.start_mark.line + 1, value_node
                break
        else:
            return line
    return line


def _type_error(error: OmegaConfBaseException, source: str) -> ConfigError:
    full_key = getattr(error, "full_key", None)
    if not full_key:
        return ConfigError(f"Invalid value in {source}: {_first_line(error)}.")
    schema_key = re.sub(r"\[\d+\]$", "", full_key)
    annotation = type_of_key(re.sub(r"\[\d+\]", "", schema_key))
    if annotation is not None and schema_key != full_key:  # one element of a list
        annotation = (typing.get_args(_strip_optional(annotation)) or (None,))[0]
    expected = describe_type(annotation) if annotation is not None else None
    given = getattr(error, "value", None)
    message = f"Wrong type for '{full_key}' ({source}): got {given!r}"
    if expected:
        message += f", expected {expected}."
    else:
        message += f": {_first_line(error)}."
    return ConfigError(message)


def _to_object(merged: DictConfig) -> ExperimentConfig:
    try:
        return OmegaConf.to_object(merged)
    except MissingMandatoryValue as error:
        key = error.full_key
        raise ConfigError(
            f"'{key}' is required but not set: add it to the YAML file or pass {key}=VALUE on the command line."
        ) from None
    except InterpolationResolutionError as error:
        raise ConfigError(
            f"Cannot resolve '{error.full_key}': {_first_line(error)}. Interpolations name the full "
            "dotted key, e.g. ${data.max_response_length}."
        ) from None
    except OmegaConfBaseException as error:
        raise _type_error(error, "after interpolation") from None
    except ValueError as error:  # a section's own __post_init__ check (e.g. reward_model)
        raise ConfigError(str(error)) from None


def ulysses_meaning(size: int) -> str:
    """What ``ULYSSES_KEY=size`` sets, as the start of a run prints it."""
    return (f"{ULYSSES_KEY}={size} runs as megatron's context parallelism: actor_rollout_ref.actor.megatron."
            f"context_parallel_size={size}, cp_comm_type=a2a (Ulysses' all-to-all over attention heads)")


def _read_ulysses_as_context_parallel(merged: DictConfig) -> None:
    """verl's Ulysses sequence parallelism is megatron's CP with the a2a exchange; set it before the
    critic's and reward model's layouts are resolved from the actor's."""
    size = OmegaConf.select(merged, ULYSSES_KEY)
    if not isinstance(size, int) or size <= 1:
        if isinstance(size, int) and size < 1:
            raise ConfigError(f"{ULYSSES_KEY}={size}: must be >= 1 (1 = no sequence split).")
        return
    megatron = "actor_rollout_ref.actor.megatron"
    context = OmegaConf.select(merged, f"{megatron}.context_parallel_size")
    if context not in (1, size):
        raise ConfigError(
            f"{ULYSSES_KEY}={size} means {megatron}.context_parallel_size={size}, but that key is set to "
            f"{context}: set one of the two keys only.")
    comm = OmegaConf.select(merged, f"{megatron}.cp_comm_type")
    if comm not in ("p2p", "a2a"):  # p2p is the default: a value the user did not choose
        raise ConfigError(
            f"{ULYSSES_KEY}={size} means {megatron}.cp_comm_type=a2a (Ulysses' all-to-all), but that key is set "
            f"to {comm!r}: set context_parallel_size with cp_comm_type={comm} instead of the Ulysses key.")
    OmegaConf.update(merged, f"{megatron}.context_parallel_size", size)
    OmegaConf.update(merged, f"{megatron}.cp_comm_type", "a2a")


def _fill_derived_defaults(config: ExperimentConfig) -> None:
    model = config.actor_rollout_ref.model
    if model.tokenizer_path is None:
        model.tokenizer_path = model.path
    reward_model = config.reward_model.model
    if reward_model.tokenizer_path is None:
        reward_model.tokenizer_path = reward_model.path
    for dotted in PATH_KEYS:
        owner_path, _, attribute = dotted.rpartition(".")
        owner = config
        for part in owner_path.split("."):
            owner = getattr(owner, part)
        value = getattr(owner, attribute)
        if isinstance(value, str):
            setattr(owner, attribute, os.path.expanduser(value))
        elif isinstance(value, list):
            setattr(owner, attribute, [os.path.expanduser(item) for item in value])


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


# ----------------------------------------------------------------------------- schema introspection


@functools.lru_cache(maxsize=None)
def schema_fields(cls: type) -> dict[str, Any]:
    """Field name -> resolved type annotation of a schema dataclass, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def section_class(annotation: Any) -> type | None:
    """The dataclass behind ``annotation`` (Optional unwrapped), or None for a plain value."""
    annotation = _strip_optional(annotation)
    return annotation if dataclasses.is_dataclass(annotation) else None


@functools.lru_cache(maxsize=None)
def all_keys(cls: type = ExperimentConfig, prefix: str = "") -> tuple[str, ...]:
    """Every dotted key of the schema, sections included."""
    keys: list[str] = []
    for name, annotation in schema_fields(cls).items():
        keys.append(prefix + name)
        section = section_class(annotation)
        if section is not None:
            keys.extend(all_keys(section, f"{prefix}{name}."))
    return tuple(keys)


def type_of_key(dotted: str) -> Any:
    """The annotation of a dotted schema key, or None if there is no such key."""
    cls: Any = ExperimentConfig
    annotation = None
    for part in dotted.split("."):
        if cls is None:
            return None
        fields = schema_fields(cls)
        if part not in fields:
            return None
        annotation = fields[part]
        cls = section_class(annotation)
    return annotation


def describe_type(annotation: Any) -> str:
    """A human name for a type annotation: 'an integer', 'a list of numbers', 'a string or null'."""
    inner = _strip_optional(annotation)
    if inner is not annotation:
        return f"{describe_type(inner)} or null"
    origin = typing.get_origin(annotation)
    if origin in (list, Sequence):
        (item,) = typing.get_args(annotation) or (Any,)
        return f"a list of {_plural(describe_type(item))}"
    if origin in (dict, Mapping) or annotation in (dict, Mapping):
        return "a mapping"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", Any: "any value"}
    if annotation in names:
        return names[annotation]
    if dataclasses.is_dataclass(annotation):
        return "a section (mapping)"
    return getattr(annotation, "__name__", str(annotation))


def _plural(description: str) -> str:
    plurals = {"an integer": "integers", "a number": "numbers", "a string": "strings",
               "true or false": "booleans"}
    return plurals.get(description, description)


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation
