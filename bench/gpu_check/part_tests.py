"""Part `tests`: the test modules whose code takes another path with CUDA, run by pytest on the GPU.

Without a GPU these run on CPU under the Triton interpreter (tests/kernels/conftest.py and the
modules themselves set TRITON_INTERPRET=1 only when torch sees no CUDA device); here they run
compiled for the GPU. Modules are named by file name and found wherever they live under tests/, so
moving them between folders does not lose them; a name that matches no file, or two, fails the part.
tests/bench/test_gpu_check.py keeps these tables complete: every test module that mentions CUDA or
runs on the kernel tests' DEVICE must be listed here or in NOT_CUDA (or be a test_cpu_*.py).

Failed, errored and skipped tests all fail the part: on a GPU machine nothing may skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tandem.bench.gpu_check.report import CheckFailed, main_of, require

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

CUDA_TESTS = {
    "test_decode_attention.py": "paged decode attention kernel on the GPU (tests/kernels/helpers.DEVICE)",
    "test_extend_attention.py": "extend (prefill) attention kernel on the GPU",
    "test_kv_pack.py": "KV page pack/unpack kernels on the GPU",
    "test_kv_store.py": "KV store kernel on the GPU",
    "test_lora_kernels.py": "LoRA shrink/expand kernels and the engine's LoRA batch on them, on the GPU",
    "test_rmsnorm.py": "RMSNorm kernel on the GPU",
    "test_rope.py": "RoPE kernel on the GPU",
    "test_triton_backend.py": "the engine with the triton backend on CUDA against the torch backend and HF",
    "test_graph_runner.py": "CUDA graph capture and replay against eager",
}

# Tests of the CUDA modules that assert the CPU path itself; running them on CUDA checks nothing.
DESELECT = {
    "test_graph_runner.py::test_compiled_matches_eager_with_padding_and_fallback":
        "asserts the CPU runner (graphs.kind == 'inductor'); on CUDA the engine captures CUDA graphs, "
        "which test_compiled_with_overlap_schedule_matches_eager and part `engine` compare with eager",
    "test_graph_runner.py::test_padding_rows_touch_no_kv_and_change_no_real_row":
        "indexes a CPU mask with the step's slots, which live on the engine's device (CUDA here)",
}

# Test modules that mention CUDA but take no CUDA path (and every test_cpu_*.py: the C++ CPU kernels).
NOT_CUDA_PREFIX = "test_cpu_"
NOT_CUDA = {
    "test_isa.py": "CPU ISA levels",
    "test_gpu_compile.py": "compiles for sm_90 without a GPU (slow); this run executes the kernels instead",
    "test_hardware.py": "hardware defaults on fake Hardware records",
}


def find(name: str, root: Path = TESTS) -> Path:
    found = sorted(root.rglob(name))
    if len(found) != 1:
        raise CheckFailed(f"test module {name} should be one file under {root}, found {len(found)}: {found}")
    return found[0]


def pytest_args(junit: Path, root: Path = TESTS) -> list[str]:
    paths = {name: find(name, root) for name in CUDA_TESTS}
    args = ["-q", "-m", "not slow", "-p", "no:cacheprovider", "-o", "addopts=-ra", f"--junitxml={junit}"]
    for node in DESELECT:
        name, test = node.split("::", 1)
        args += ["--deselect", f"{paths[name].relative_to(ROOT)}::{test}"]
    return args + [str(p.relative_to(ROOT)) for p in paths.values()]


def junit_summary(path: Path) -> dict:
    """Counts, and the id and message of every test that did not pass, from pytest's JUnit XML."""
    root = ET.parse(path).getroot()
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    bad: list[dict] = []
    for case in root.iter("testcase"):
        counts["tests"] += 1
        for kind, key in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
            el = case.find(kind)
            if el is not None:
                counts[key] += 1
                text = (el.get("message") or el.text or "").strip()
                bad.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": kind,
                            "message": text[:400]})
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "not_passed": bad}


def run(report, args) -> None:
    import torch

    require(torch.cuda.is_available(), "torch sees no CUDA device")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    junit = Path(args.result).with_name("junit.xml") if args.result else ROOT / "bench" / "results" / "junit.xml"
    cmd = [sys.executable, "-P", "-m", "pytest", *pytest_args(junit)]
    report.details.update(modules=CUDA_TESTS, deselected=DESELECT, command=" ".join(cmd[1:]))
    report.save()
    # pytest gets what is left of the part's time but a margin, so the part can still read its XML.
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=max(report.left_s() - 10, 5))
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = None
    summary = junit_summary(junit) if junit.exists() else None
    report.details.update(exit_code=rc, junit=summary)
    require(rc is not None, "pytest ran out of time" + (f" after {summary['tests']} tests" if summary else ""))
    require(summary is not None, f"pytest exited with {rc} and wrote no JUnit XML")
    require(summary["tests"] > 0, "pytest ran no test")
    bad = summary["not_passed"]
    require(not bad, f"{len(bad)} of {summary['tests']} tests did not pass: "
            + "; ".join(f"{b['test']} {b['outcome'].upper()} {b['message'][:150]}" for b in bad[:8]))
    require(rc == 0, f"pytest exited with {rc}")


if __name__ == "__main__":
    main_of(run)
