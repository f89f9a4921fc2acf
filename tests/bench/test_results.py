"""bench/results.py: the one writer of results JSON, and a scan that no script under bench/ writes one by hand."""

from __future__ import annotations

import ast
import json
import math
import sys
import time
import types
from pathlib import Path

import pytest

from tandem.bench import results
from tandem.bench.results import command_line, write_result

BENCH = Path(__file__).resolve().parents[2] / "bench"

# JSON that bench/ writes and that is not a results file, each with why it is written by hand.
NOT_RESULTS = {
    "gpu_check/report.py": "a part's result file: the part -> runner protocol (the runner reads it back)",
    "gpu_check/part_nixl.py": "messages to the NIXL peer process, on its stdin",
    "gpu_check/bundle.py": "the bundle's manifest.json (what `make gpu-bundle` carries), not a measurement",
    "gpu_check/models.py": "a tiny model's Hugging Face config.json / generation_config.json",
}


def test_write_result_stamps_tool_command_and_date_and_makes_the_folders(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/x/bench/chaos.py", "--model", "a b", "--out", "o.json"])
    data = {"rows": [1, 2]}
    path = write_result(tmp_path / "new" / "dir" / "r.json", data, tool="tandem.bench.chaos")
    assert path == tmp_path / "new" / "dir" / "r.json"
    text = path.read_text()
    assert text.startswith('{\n "tool": ') and text.endswith("}\n")       # indent 1, a trailing newline
    doc = json.loads(text)
    assert list(doc) == ["tool", "command", "date", "rows"] and doc["rows"] == [1, 2]
    assert doc["tool"] == "tandem.bench.chaos"
    assert doc["command"].endswith(" --model 'a b' --out o.json")
    assert abs(time.mktime(time.strptime(doc["date"], "%Y-%m-%dT%H:%M:%S%z")) - time.time()) < 60
    assert data == {"rows": [1, 2]}                                           # the caller's dict is left alone
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]              # no temporary file left


def test_write_result_keeps_the_callers_keys_and_rewrites_the_file(tmp_path):
    given = {"tool": "tandem bench serve", "date": "2024-01-01T00:00:00+0000", "command": "mine", "runs": []}
    path = write_result(tmp_path / "r.json", given, tool="tandem.bench.serve")
    assert json.loads(path.read_text()) == given
    write_result(path, {"date": "later"}, tool="t")
    assert json.loads(path.read_text())["date"] == "later"


def test_write_result_writes_what_json_has_no_literal_for():
    assert results._json_safe({"a": math.nan, "b": [math.inf, -math.inf, 1.5], 3: (1, 2)}) == \
        {"a": None, "b": ["inf", "-inf", 1.5], "3": [1, 2]}


def test_write_result_nan_inf_paths_and_tuples(tmp_path):
    path = write_result(tmp_path / "r.json", {"nan": math.nan, "inf": math.inf, "ninf": [-math.inf],
                                              "nested": {"x": (math.nan, 2)}, "path": Path("/a/b"), 1: "int key"},
                        tool="t")
    doc = json.loads(path.read_text())        # strict JSON: no NaN / Infinity literals
    assert doc["nan"] is None and doc["inf"] == "inf" and doc["ninf"] == ["-inf"]
    assert doc["nested"] == {"x": [None, 2]} and doc["path"] == "/a/b" and doc["1"] == "int key"
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()


@pytest.mark.parametrize(("spec", "argv0", "expected"), [
    ("tandem.bench.chaos", "/t/bench/chaos.py", "python -m tandem.bench.chaos --x 1"),
    ("tandem.cli.__main__", "/t/tandem/cli/__main__.py", "python -m tandem.cli --x 1"),
    (None, "/venv/bin/tandem", "tandem --x 1"),
    (None, "bench/chaos.py", "python bench/chaos.py --x 1"),
    (None, "-c", "python -m tandem.bench.tool --x 1"),
])
def test_the_command_is_how_this_process_was_started(monkeypatch, spec, argv0, expected):
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name=spec) if spec else None
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", [argv0, "--x", "1"])
    assert command_line("tandem.bench.tool") == expected


# ---- no results JSON written by hand ----------------------------------------------------------------

def _is_json_call(node: ast.AST, name: str) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "json")


def hand_written_json(source: str) -> list[int]:
    """Lines that write JSON themselves: json.dump(...), or .write_text / .write / .writelines of a
    json.dumps(...) (directly, or through a name assigned one)."""
    tree = ast.parse(source)
    dumped = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
              and any(_is_json_call(n, "dumps") for n in ast.walk(node.value))
              for t in node.targets if isinstance(t, ast.Name)}
    lines = []
    for node in ast.walk(tree):
        if _is_json_call(node, "dump"):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("write_text", "write", "writelines")):
            inner = [n for a in node.args for n in ast.walk(a)]
            if any(_is_json_call(n, "dumps") or (isinstance(n, ast.Name) and n.id in dumped) for n in inner):
                lines.append(node.lineno)
    return lines


def test_the_scan_catches_each_way_of_writing_json_by_hand():
    assert hand_written_json("Path(o).write_text(json.dumps(r, indent=2))") == [1]
    assert hand_written_json("with open(o, 'w') as f:\n    json.dump(r, f)") == [2]
    assert hand_written_json("out = json.dumps(r)\nprint(out)\nargs.out.write_text(out + '\\n')") == [3]
    assert hand_written_json("f.write(json.dumps(r))") == [1]
    assert hand_written_json("print(json.dumps(r))\nlog(json.dumps(r))\nwrite_result(o, r, tool='t')") == []


def test_no_script_under_bench_writes_results_json_by_hand():
    assert all((BENCH / f).is_file() for f in NOT_RESULTS), "an allowed file is gone: drop it from NOT_RESULTS"
    found = {}
    for path in sorted(BENCH.rglob("*.py")):
        rel = path.relative_to(BENCH).as_posix()
        if rel == "results.py" or rel in NOT_RESULTS:
            continue
        lines = hand_written_json(path.read_text())
        if lines:
            found[rel] = lines
    assert not found, f"write results with tandem.bench.results.write_result, not by hand: {found}"
