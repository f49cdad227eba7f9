"""Write docs/config.md, every experiment key with its type, default and meaning, from the schema.

    python -m launch.config_docs              # rewrite docs/config.md
    python -m launch.config_docs --check      # exit 1 if docs/config.md is not what the schema gives

The schema is the config dataclasses of ``engine/config/`` (``ExperimentConfig`` and its sections);
each key's meaning is its entry in the ``Attributes:`` section of its class's docstring (or of a
base class's), types and defaults are the schema's own (what ``engine.config.load_config`` merges
onto). A key without an entry is an error, so the page cannot fall behind the code.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from engine.config.experiment import ExperimentConfig
from engine.config.loader import (ALIAS_KEYS, MEGATRON_STRATEGY, REMOVED_KEYS, RENAMED_KEYS, STRATEGY_KEYS, _schema,
                                  describe_type, schema_fields, section_class)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "docs" / "config.md"
# "name: text" or "name, other: text" at the attribute indentation.
_ENTRY = re.compile(r"^(?P<names>[A-Za-z_][A-Za-z0-9_]*(?:, [A-Za-z_][A-Za-z0-9_]*)*): ?(?P<text>.*)$")

HEADER = """# Configuration keys

Every key of an experiment file (`yaml/*.yaml`) and of a `key=value` override, by section, with its
type, its default and what it does. Generated from the config dataclasses in `engine/config/` by
`python -m launch.config_docs` (`tests/test_docs.py` fails when this page and the code differ); do
not edit by hand. Keys follow verl's PPO trainer where verl has them. `???` marks a key without a
default (required); `${...}` is an interpolation of another key.
"""


class UndocumentedKeyError(RuntimeError):
    """A schema key has no entry in its class's docstring."""


def attribute_docs(cls: type) -> dict[str, str]:
    """``name -> text`` from the ``Attributes:`` sections of ``cls`` and its dataclass bases
    (the subclass's entry wins); continuation lines are joined with spaces."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        docs.update(_parse_attributes(inspect.getdoc(klass) or ""))
    return docs


def _parse_attributes(docstring: str) -> dict[str, str]:
    lines = docstring.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return {}
    entries: dict[str, str] = {}
    names: list[str] = []
    indent = None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        if indent is None:
            indent = width
        if width < indent:  # the section ended
            break
        match = _ENTRY.match(line.strip()) if width == indent else None
        if match:
            names = match["names"].split(", ")
            for name in names:
                entries[name] = match["text"].strip()
        elif names:
            for name in names:
                entries[name] = f"{entries[name]} {line.strip()}".strip()
    return entries


def _default(value: Any) -> str:
    """The schema default as YAML would spell it (``???``: required, no default)."""
    return f"`{value if isinstance(value, str) else json.dumps(value)}`"  # JSON is YAML's flow style


def _cell(text: str) -> str:
    return text.replace("|", "&#124;")


def sections(cls: type = ExperimentConfig, prefix: str = "", defaults: Any = None):
    """``(dotted section, class, [(key, type, default, meaning)])`` for every section, depth first."""
    defaults = OmegaConf.to_container(_schema(), resolve=False) if defaults is None else defaults
    docs = attribute_docs(cls)
    rows, nested = [], []
    for name, annotation in schema_fields(cls).items():
        key = f"{prefix}{name}"
        child = section_class(annotation)
        if child is not None:
            nested.append((child, f"{key}.", (defaults or {}).get(name)))
            continue
        if name not in docs:
            raise UndocumentedKeyError(f"{key} ({cls.__module__}.{cls.__qualname__}) has no entry in the "
                                       "class docstring's Attributes section")
        value = (defaults or {}).get(name)
        rows.append((key, describe_type(annotation), _default(value), docs[name]))
    yield prefix.rstrip("."), cls, rows
    for child, child_prefix, child_defaults in nested:
        yield from sections(child, child_prefix, child_defaults)


def other_spellings() -> str:
    """verl's (and older) names: accepted as a key here, pointed to its name here, or refused with why."""
    rows = [f"| `{alias}` | read as `{key}` |" for alias, key in ALIAS_KEYS.items()]
    rows += [f"| `{key}` | `{MEGATRON_STRATEGY}` accepted (and ignored: Megatron is the only backend); "
             f"`fsdp`/`fsdp2` refused |" for key in STRATEGY_KEYS]
    rows += [f"| `{old}` | an error naming `{new}` |" for old, new in RENAMED_KEYS.items()]
    rows += [f"| `{key}` | an error: {_cell(why)} |" for key, why in REMOVED_KEYS.items()]
    return ("\n## Other spellings\n\nKeys of verl, of the seed recipe or of older Trident versions, and "
            "what an experiment that uses them gets (`engine/config/loader.py`).\n\n"
            "| key | gets |\n| --- | --- |\n" + "\n".join(rows) + "\n")


def render() -> str:
    parts = [HEADER]
    for section, cls, rows in sections():
        if not rows:
            continue
        summary = (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
        parts.append(f"\n## `{section}`\n\n{summary} (`{cls.__module__}.{cls.__qualname__}`)\n")
        parts.append("| key | type | default | meaning |\n| --- | --- | --- | --- |")
        for key, kind, default, meaning in rows:
            leaf = key.rpartition(".")[2]
            parts.append(f"| `{leaf}` | {_cell(kind)} | {default} | {_cell(meaning)} |")
    return "\n".join(parts) + "\n" + other_spellings()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = parser.parse_args(argv)
    try:
        text = render()
    except UndocumentedKeyError as error:
        print(f"launch.config_docs: {error}", file=sys.stderr)
        return 1
    if args.check:
        if not args.out.is_file() or args.out.read_text() != text:
            print(f"{args.out} is not what the schema gives: run python -m launch.config_docs", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
