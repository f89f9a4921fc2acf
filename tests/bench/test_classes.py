"""bench/serve/classes.py: per-class goodput from sweep JSONs (the README plot's numbers)."""

import argparse
import json

import pytest

from tandem.bench.serve import classes


def _sweep(tmp_path, name, runs, num_prompts=4):
    """A sweep JSON as `tandem bench sweep` writes it, with only the fields the plot reads."""
    deployments = {dep: {"runs": [{"request_rate": str(rate), "metrics": {"goodput": g, "good_requests": good}}
                                  for rate, g, good in rows]} for dep, rows in runs.items()}
    path = tmp_path / name
    path.write_text(json.dumps({"config": {"slo": "ttft<=2000ms", "dataset": {"num_prompts": num_prompts}},
                                "deployments": deployments}))
    return str(path)


def test_runs_of_one_class_are_kept_apart_per_deployment_and_rate(tmp_path):
    a = _sweep(tmp_path, "a.json", {"1p1d": [(1, 0.9, 4), (2, 1.0, 2)], "vllm": [(1, 0.5, 1)]})
    b = _sweep(tmp_path, "b.json", {"1p1d": [(1, 1.1, 4)]})
    data = classes.load([a, b])
    assert data["1p1d"][1.0] == [(0.9, 1.0), (1.1, 1.0)]
    assert data["1p1d"][2.0] == [(1.0, 0.5)]
    assert data["vllm"][1.0] == [(0.5, 0.25)]
    text = classes.table([("cpu", data)])
    assert "| cpu | 1p1d | 1 | 0.90 / 1.10 | 100% / 100% |" in text
    assert "| cpu | vllm | 1 | 0.50 | 25% |" in text


def test_plot_is_written(tmp_path):
    a = _sweep(tmp_path, "a.json", {"1p1d": [(1, 0.9, 4)], "vllm": [(1, 0.5, 1)]})
    out = tmp_path / "img" / "x.png"
    classes.plot([("one", classes.load([a])), ("two", classes.load([a]))], out, "ttft<=2s")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_runs_spec_without_files_is_refused():
    with pytest.raises(argparse.ArgumentTypeError):
        classes.parse_runs("native")
    assert classes.parse_runs("x=a.json,b.json") == ("x", ["a.json", "b.json"])
