"""`make gpu-check`: python -m tandem.bench.gpu_check [--parts tests,kernels,...] [--out FILE]

See bench/gpu_check/__init__.py for the parts and docs/gpu-check.md for running it on the GPU machine.
Exit status: 0 when every part passed, or when this machine has no GPU (it says so); 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from tandem.bench.flags import add_out_flag
from tandem.bench.gpu_check import bundle, gpu
from tandem.bench.gpu_check.runner import ROOT, Part, Run, link_checkout, module_part, run_all, summary

BUDGET_S = 465.0     # the whole run, bundle install included, inside the 8 minutes asked for

PARTS = {
    "tests": module_part("tests", "tandem.bench.gpu_check.part_tests", 180,
                         "the CUDA test subset with pytest on the GPU (no Triton interpreter)"),
    "kernels": module_part("kernels", "tandem.bench.gpu_check.part_kernels", 60,
                           "Triton kernels vs torch references: agreement, GB/s, % of peak"),
    "engine": module_part("engine", "tandem.bench.gpu_check.part_engine", 80,
                          "engine on CUDA: CUDA graphs vs eager, decode tokens/s by batch"),
    "nixl": module_part("nixl", "tandem.bench.gpu_check.part_nixl", 60,
                        "two processes: NIXL WRITEs of KV pages between device memories"),
    "disagg": module_part("disagg", "tandem.bench.gpu_check.part_disagg", 60,
                          "1P1D over NIXL on the GPU: router, prefill and decode processes"),
}


def default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "gpu_check.json" if out else ROOT / "bench" / "results" / "gpu_check.json"


def select(names: str) -> list[Part]:
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in PARTS]
    if unknown or not chosen:
        raise SystemExit(f"--parts: choose from {','.join(PARTS)}; got {names!r}")
    return [PARTS[n] for n in chosen]


def prepare_bundle(folder: Path, site: Path) -> dict:
    """Install the carried wheels into `site` and put the carried stubs into tandem/v1."""
    t0 = time.monotonic()
    info: dict = {"dir": str(folder), "ok": True, "wheels": [], "stubs_placed": [], "error": None}
    try:
        if not (folder / "wheels").is_dir():
            info["note"] = f"no bundle at {folder}: nothing installed (make gpu-bundle makes one)"
        else:
            info["wheels"] = bundle.install(folder, site)
            info["site"] = str(site)
        info["stubs_placed"] = bundle.place_stubs(folder)
    except Exception as e:
        info.update(ok=False, error=f"{type(e).__name__}: {e}")
    info["seconds"] = round(time.monotonic() - t0, 1)
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of: " + ",".join(PARTS))
    add_out_flag(p, type=Path, help="the run's JSON (default: $OUT/gpu_check.json, else bench/results/gpu_check.json)")
    p.add_argument("--bundle", type=Path, default=ROOT / ".gpu", help="what `make gpu-bundle` made")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run's time limit")
    p.add_argument("--require-gpu", action="store_true", help="no GPU is a failure, not a reason to stop")
    args = p.parse_args(argv)
    parts = select(args.parts)
    out = args.out or default_out()

    found = gpu.probe()
    if not found.cuda:
        if found.signs or args.require_gpu:
            print(f"gpu-check: FAILED: this machine shows an NVIDIA GPU ({', '.join(found.signs) or '--require-gpu'})"
                  f" but torch {found.torch} cannot use it: {found.reason}", file=sys.stderr)
            return 1
        print(f"gpu-check: no GPU on this machine ({found.reason}; torch {found.torch}): nothing to check.")
        return 0

    run = Run(out=out, log=out.with_suffix(".log"))
    if run.log.exists():
        run.log.unlink()
    run.header["machine"] = gpu.describe()
    print(f"gpu-check: {run.header['machine']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="tandem-gpu-site-") as site:
        run.header["bundle"] = prepare_bundle(args.bundle, Path(site))
        run.write()
        print(f"gpu-check: bundle: {run.header['bundle']}", flush=True)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        link_checkout(Path(site))   # tandem and tests from this tree; the tree itself stays off the path
        env["PYTHONPATH"] = os.pathsep.join(x for x in (site, os.environ.get("PYTHONPATH")) if x)
        env["PYTHONUNBUFFERED"] = "1"
        env["HF_HUB_OFFLINE"] = env["TRANSFORMERS_OFFLINE"] = "1"
        run_all(parts, env, args.budget_s, run)
    result = run.as_dict()
    run.write()
    print(summary(run))
    if result["ok"]:
        print(f"gpu-check: all {len(parts)} parts passed in {result['total_s']} s; JSON: {out}")
        return 0
    print(f"gpu-check: FAILED: {', '.join(result['failed'])} (JSON: {out}, log: {run.log})", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
