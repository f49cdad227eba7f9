"""README.md and docs/: short front door, generated key reference, and nothing that points nowhere.

Every relative link must reach a file (and its #anchor a heading there); every ``python -m X`` must
name a module that exists; every ``trident``/``.venv/bin/trident`` experiment, ``make`` target and
repository path written in them must exist. Placeholders (``yaml/X.yaml``, ``<run>``) are skipped.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from launch import config_docs

REPO_ROOT = Path(__file__).resolve().parent.parent
PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 150
TOP_LEVEL = ("engine", "parallel", "launch", "benchmarks", "tests", "yaml", "docs", "requirements", ".ci")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
PYTHON_M = re.compile(r"python3?(?:\.\d+)? -m ([A-Za-z_][\w.]*)")
TRIDENT = re.compile(r"(?:^|[\s/])trident (\S+\.yaml)")
MAKE = re.compile(r"(?:^|\s)make ([a-z][\w-]*)")
PATH = re.compile(rf"(?<![\w./<-])((?:{'|'.join(re.escape(t) for t in TOP_LEVEL)})/[\w./*-]*)")


def code_text(text: str) -> list[str]:
    """The code of a page: fenced blocks and inline code spans."""
    return FENCE.findall(text) + CODE_SPAN.findall(FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in FENCE.sub("", page.read_text()).splitlines() if line.startswith("#")}


def is_placeholder(path: str) -> bool:
    name = Path(path).stem
    return len(name) == 1 and name.isupper()


def test_readme_is_a_front_door():
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md has {len(lines)} lines; depth belongs in docs/"
    text = "\n".join(lines)
    assert "make demo" in text and "make test" in text


def test_config_reference_is_generated_from_the_schema():
    assert (REPO_ROOT / "docs" / "config.md").read_text() == config_docs.render(), \
        "docs/config.md is stale: run python -m launch.config_docs"


def test_every_schema_key_has_a_documented_meaning():
    documented = {key for _, _, rows in config_docs.sections() for key, *_ in rows}
    from engine.config.loader import all_keys, section_class, type_of_key

    assert documented == {key for key in all_keys() if section_class(type_of_key(key)) is None}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path_text, _, anchor = target.partition("#")
        path = (page.parent / path_text).resolve() if path_text else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.name}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_commands_and_paths_exist(page):
    code = "\n".join(code_text(page.read_text()))
    missing = [f"python -m {module}" for module in PYTHON_M.findall(code) if importlib.util.find_spec(module) is None]
    missing += [f"trident {yaml}" for yaml in TRIDENT.findall(code)
                if not is_placeholder(yaml) and not (REPO_ROOT / yaml).is_file()]
    targets = re.findall(r"^([\w-]+):", (REPO_ROOT / "Makefile").read_text(), re.M)
    missing += [f"make {target}" for target in MAKE.findall(code) if target not in targets]
    for path in PATH.findall(code):
        path = path.rstrip(".")
        if is_placeholder(path):
            continue
        found = list(REPO_ROOT.glob(path)) if "*" in path else [REPO_ROOT / path] if (REPO_ROOT / path).exists() else []
        if not found:
            missing.append(path)
    assert not missing, f"{page.name} names what does not exist: {missing}"
