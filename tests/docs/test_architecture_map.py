"""docs/architecture.md's maps of engine/ and kvtransfer/ match the tree: every file they name
exists where they put it, and every module of those trees is named (so a moved, added or deleted
file fails here until the map is updated)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
MAPS = {"engine": "## The engine (`engine/`)", "kvtransfer": "### The transfer layer (`kvtransfer/`)"}
_MODULE = re.compile(r"\b([a-z_][a-z0-9_]*\.py)\b")


def map_block(heading: str) -> list[str]:
    """The first fenced block after `heading`."""
    text = DOC.read_text()
    start = text.index(heading)
    body = text[start:].split("```", 2)[1]
    return body.strip("\n").splitlines()


def named_paths(lines: list[str]) -> set[str]:
    """Paths (relative to the mapped folder) of every module a map names. A line at indent 0 names
    root files or a folder (`kvcache/`); deeper lines belong to the folder above them; a folder's own
    line may name its files in its description (`attention/  ... base.py, torch_backend.py`)."""
    folder = ""
    out = set()
    for line in lines:
        indent = len(line) - len(line.lstrip(" "))
        first = line.split()[0] if line.strip() else ""
        if indent == 0:
            folder = first if first.endswith("/") else ""
        for name in _MODULE.findall(line):
            out.add(folder + name)
    return out


@pytest.mark.parametrize("root", sorted(MAPS))
def test_the_map_matches_the_tree(root):
    named = named_paths(map_block(MAPS[root]))
    files = {p.relative_to(ROOT / root).as_posix() for p in (ROOT / root).rglob("*.py") if "__pycache__" not in p.parts}
    modules = {f for f in files if not f.endswith("__init__.py")}   # a package's __init__ may go unnamed
    assert not named - files, f"docs/architecture.md names files {root}/ does not have: {sorted(named - files)}"
    assert not modules - named, f"{root}/ has files docs/architecture.md's map does not name: {sorted(modules - named)}"


def test_the_parser_reads_folders_and_descriptions():
    lines = ["engine.py    the root", "kvcache/     pages", "  kv_pool.py   pool", "attention/   base.py, torch.py",
             "spec/        ngram.py and x.py", "  deeper.py  with also.py", "      (continued cont.py)"]
    assert named_paths(lines) == {"engine.py", "kvcache/kv_pool.py", "attention/base.py", "attention/torch.py",
                                  "spec/ngram.py", "spec/x.py", "spec/deeper.py", "spec/also.py", "spec/cont.py"}
