"""Goodput per deployment and request rate across CPU classes, from several `tandem bench sweep` runs.

    python -m tandem.bench.serve.classes --out docs/img/sweep_cpu_classes.png \\
        --runs "AVX-512 BF16 (native)=bench/results/w3/sweep_native_s0.json,bench/results/w3/sweep_native_s1.json" \\
        --runs "AVX2-only (emulated)=bench/results/w3/sweep_avx2_s0.json,bench/results/w3/sweep_avx2_s1.json"

One panel per CPU class: a bar per deployment and offered rate at the mean share of requests served
within the SLO over the runs (seeds), a line from the lowest to the highest run (the run-to-run
spread). The share, not goodput in req/s, is what compares across seeds: each seed draws its own
arrivals, so the req/s a deployment could reach differs from run to run (0.78 vs 1.17 req/s at an
offered 1 req/s with 32 requests). Also prints the table for docs/benchmarks.md: goodput req/s and
share of each run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.bench.flags import add_out_flag


def load(paths: list[str]) -> dict[str, dict[float, list[tuple[float, float]]]]:
    """{deployment: {rate: [(goodput req/s, share of requests within the SLO) of each run]}}."""
    out: dict[str, dict[float, list[tuple[float, float]]]] = {}
    for path in paths:
        sweep = json.loads(Path(path).read_text())
        for name, dep in sweep["deployments"].items():
            for run in dep["runs"]:
                out.setdefault(name, {}).setdefault(float(run["request_rate"]), []).append(
                    (run["metrics"]["goodput"], run["metrics"]["good_requests"] / sweep["config"]["dataset"]["num_prompts"]))
    return out


def parse_runs(spec: str) -> tuple[str, list[str]]:
    label, sep, paths = spec.partition("=")
    if not sep or not paths:
        raise argparse.ArgumentTypeError(f"--runs wants LABEL=sweep.json[,sweep.json...], got {spec!r}")
    return label, paths.split(",")


def table(classes: list[tuple[str, dict]]) -> str:
    rows = ["| CPU class | deployment | offered req/s | goodput req/s, each run | within SLO, each run |",
            "|---|---|---:|---:|---:|"]
    for label, data in classes:
        for name, by_rate in data.items():
            for rate, runs in sorted(by_rate.items()):
                rows.append(f"| {label} | {name} | {rate:g} | {' / '.join(f'{g:.2f}' for g, _ in runs)} "
                            f"| {' / '.join(f'{s:.0%}' for _, s in runs)} |")
    return "\n".join(rows)


def plot(classes: list[tuple[str, dict]], out: Path, slo: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(classes), figsize=(5.2 * len(classes), 3.6), sharey=True, squeeze=False)
    for ax, (label, data) in zip(axes[0], classes, strict=True):
        names = list(data)
        rates = sorted({r for by_rate in data.values() for r in by_rate})
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            xs, means, lo, hi = [], [], [], []
            for j, rate in enumerate(rates):
                vals = [100 * share for _, share in data[name].get(rate, [])]
                if not vals:
                    continue
                xs.append(j + (i - (len(names) - 1) / 2) * width)
                means.append(sum(vals) / len(vals))
                lo.append(means[-1] - min(vals))
                hi.append(max(vals) - means[-1])
            ax.bar(xs, means, width * 0.92, label=name, yerr=[lo, hi], capsize=3)
        ax.set_xticks(range(len(rates)), [f"{r:g} req/s offered" for r in rates])
        ax.set_ylim(0, 105)
        ax.set_title(label, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel(f"% of requests within the SLO\n[{slo}]")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=len(labels), frameon=False)
    fig.suptitle("requests served within the SLO, by CPU class (bars: mean of runs; whiskers: min-max)", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=parse_runs, action="append", required=True,
                    help="LABEL=sweep.json[,sweep.json...]: one CPU class and its sweeps (repeat per class)")
    add_out_flag(ap, type=Path, required=True, help="PNG to write")
    args = ap.parse_args()
    classes = [(label, load(paths)) for label, paths in args.runs]
    first = json.loads(Path(args.runs[0][1][0]).read_text())
    print(table(classes))
    plot(classes, args.out, first["config"]["slo"])
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
