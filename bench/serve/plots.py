"""PNG plots: latency CDFs, and throughput / goodput / latency against the offered request rate.

matplotlib is imported lazily (Agg backend, no display); without it the plots are skipped with a
warning and the JSON results are unaffected.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        log.warning("matplotlib is not installed: skipping plots (pip install matplotlib)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cdf(ax, values_ms: Sequence[float], label: str) -> None:
    xs = sorted(values_ms)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step([xs[0], *xs], [0.0, *ys], where="post", label=label)


def plot_cdfs(series: Mapping[str, Mapping[str, Sequence[float]]], path: Path, title: str = "") -> Path | None:
    """series: label -> {"TTFT": [ms...], "TPOT": [...], "ITL": [...], "E2E": [...]}."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, metric in zip(axes.flat, ("TTFT", "TPOT", "ITL", "E2E"), strict=True):
        for label, values in series.items():
            _cdf(ax, values.get(metric, []), label)
        ax.set_xlabel(f"{metric} (ms)")
        ax.set_ylabel("fraction of requests" if metric != "ITL" else "fraction of token gaps")
        ax.set_xscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(f"{metric} CDF")
    axes.flat[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(plt, fig, path)


def plot_capacity(series: Mapping[str, Sequence[tuple[float, float]]], goal: float, path: Path,
                  title: str = "") -> Path | None:
    """SLO attainment against the request rate, every run of each deployment's capacity search."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, points in series.items():
        pts = sorted(points)
        ax.plot([r for r, _ in pts], [100 * a for _, a in pts], "o-", label=label, alpha=0.8)
    ax.axhline(100 * goal, color="gray", linestyle="--", label=f"goal {goal:.0%}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("requests within the SLO (%)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return _save(plt, fig, path)


def rate_label(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}"


def plot_vs_rate(series: Mapping[str, Sequence[tuple[float, dict]]], path: Path, title: str = "") -> Path | None:
    """series: label -> [(offered rate, BenchMetrics.to_dict()), ...]. Six panels: request throughput
    and goodput, output tokens/s, TTFT, TPOT and ITL (p50 solid, p99 dashed), ITL p99/p50."""
    plt = _pyplot()
    if plt is None:
        return None
    rates = sorted({r for points in series.values() for r, _ in points})
    pos = {r: i for i, r in enumerate(rates)}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    ax_req, ax_tok, ax_ttft, ax_tpot, ax_itl, ax_ratio = axes.flat
    for i, (label, points) in enumerate(series.items()):
        style = dict(color=f"C{i}")
        xs = [pos[r] for r, _ in points]
        ax_req.plot(xs, [m["request_throughput"] for _, m in points], "o-", label=f"{label} throughput", **style)
        ax_req.plot(xs, [m["goodput"] for _, m in points], "s--", label=f"{label} goodput", **style)
        ax_tok.plot(xs, [m["output_throughput"] for _, m in points], "o-", label=label, **style)
        for ax, key in ((ax_ttft, "ttft"), (ax_tpot, "tpot"), (ax_itl, "itl")):
            ax.plot(xs, [m[key]["percentiles"].get("p50") for _, m in points], "o-", label=f"{label} p50", **style)
            ax.plot(xs, [m[key]["percentiles"].get("p99") for _, m in points], "s--", label=f"{label} p99", **style)
        ax_ratio.plot(xs, [m["itl_p99_over_p50"] for _, m in points], "o-", label=label, **style)
    ax_req.set(ylabel="requests/s", title=f"throughput (solid), goodput (dashed)\n[{_slo_of(series)}]")
    ax_tok.set(ylabel="output tokens/s", title="output token throughput")
    for ax, name in ((ax_ttft, "TTFT"), (ax_tpot, "TPOT"), (ax_itl, "ITL")):
        ax.set(ylabel=f"{name} (ms)", title=f"{name} p50 (solid), p99 (dashed)")
        ax.set_yscale("log")
    ax_ratio.set(ylabel="ITL p99 / p50", title="ITL tail: p99 / p50 (1 = perfectly smooth)")
    for ax in axes.flat:
        ax.set_xticks(range(len(rates)), [rate_label(r) for r in rates])
        ax.set_xlabel("offered request rate (req/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    return _save(plt, fig, path)


def _slo_of(series: Mapping[str, Sequence[tuple[float, dict]]]) -> str:
    for points in series.values():
        for _, m in points:
            return m.get("slo", "")
    return ""


def plot_timeline(series: Mapping[str, Sequence[dict]], path: Path, title: str = "",
                  shapes: Mapping[str, Sequence[dict]] | None = None) -> Path | None:
    """A load-profile run over time. series: label -> time-series rows (load_profile.time_series);
    shapes: label -> [{"t_s", "prefill", "decode", "colocated"}, ...] (worker counts sampled from the
    router), drawn as a third panel when given. Panels: offered load, shape, goodput."""
    plt = _pyplot()
    if plt is None:
        return None
    n = 3 if shapes else 2
    fig, axes = plt.subplots(n, 1, figsize=(12, 3.2 * n), sharex=True)
    ax_load, ax_good = axes[0], axes[-1]
    first = next(iter(series.values()), [])
    if first:
        w = first[1]["t_s"] - first[0]["t_s"] if len(first) > 1 else 1.0
        ts = [r["t_s"] for r in first]
        ax_load.step([*ts, ts[-1] + w], [*(r["offered_rate"] for r in first), first[-1]["offered_rate"]],
                     where="post", color="k", label="offered rate (phase)")
        ax_load.bar(ts, [r["sent"] / w for r in first], width=w, align="edge", alpha=0.3, color="C7",
                    label=f"sent per {w:g} s window (/s)")
    ax_load.set(ylabel="requests/s", title="load")
    for i, (label, rows) in enumerate(series.items()):
        if rows:
            w = rows[1]["t_s"] - rows[0]["t_s"] if len(rows) > 1 else 1.0
            ax_good.step([*(r["t_s"] for r in rows), rows[-1]["t_s"] + w],
                         [*(r["goodput"] for r in rows), rows[-1]["goodput"]], where="post", color=f"C{i}",
                         linestyle=("-", "--", ":", "-.")[i % 4], label=label)
    ax_good.set(ylabel="goodput (req/s)", title="goodput per window (requests that met the SLO, by end time)",
                xlabel="time since start (s)")
    if shapes:
        ax_shape = axes[1]
        for i, (label, samples) in enumerate(shapes.items()):
            ts = [s["t_s"] for s in samples if "error" not in s]
            up = 0.04 * i  # deployments with the same shape stay apart
            ax_shape.step(ts, [s["prefill"] + up for s in samples if "error" not in s], where="post",
                          color=f"C{i}", label=f"{label} prefill")
            ax_shape.step(ts, [s["decode"] + s["colocated"] + up for s in samples if "error" not in s], where="post",
                          color=f"C{i}", linestyle="--", label=f"{label} decode / co-located")
        top = max((s["prefill"] + s["decode"] + s["colocated"] for v in shapes.values() for s in v if "error" not in s),
                  default=1)
        ax_shape.set_ylim(-0.2, top + 0.5)
        ax_shape.set_yticks(range(top + 1))
        ax_shape.set(ylabel="workers", title="shape: prefill (solid), decode or co-located (dashed) workers")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    if title:
        fig.suptitle(title)
    return _save(plt, fig, path)
