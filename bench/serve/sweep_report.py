"""What `tandem bench sweep` prints and plots from its results: an aligned table for the terminal, a
Markdown table for the .md file, the issues' targets checked per rate (in words), and the figures."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.bench.serve import plots
from tandem.bench.serve.serve import cdf_values

if TYPE_CHECKING:
    from tandem.bench.serve.metrics import SLO
    from tandem.bench.serve.sweep import SweepConfig

_DISAGG = re.compile(r"^(\d+)p(\d+)d$")   # deployment names NpMd
_COLOCATED = re.compile(r"^colocated(?:-dp(\d+))?$")   # colocated, colocated-dpN


def _rows(results: dict):
    for name, dep in results["deployments"].items():
        for run in dep["runs"]:
            yield name, run["request_rate"], run["metrics"]


def _later_turns(results: dict) -> dict[tuple[str, str], dict] | None:
    """(deployment, rate) -> TTFT stats of turns >= 2 when the workload was multi-turn, else None
    (and the tables keep their usual columns)."""
    out = {(name, run["request_rate"]): run["multi_turn"]["ttft_turns_2_plus"]
           for name, dep in results["deployments"].items() for run in dep["runs"] if "multi_turn" in run}
    return out or None


def comparison_table(results: dict) -> str:
    def f(x, digits=0):
        return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"

    later = _later_turns(results)
    head = ("| deployment | offered req/s | achieved req/s | output tok/s | goodput req/s (% of requests) | "
            "TTFT p50 / p99 ms | " + ("TTFT turns ≥ 2 p50 / p99 ms | " if later else "")
            + "TPOT p50 / p99 ms | ITL p50 / p99 ms | ITL p99/p50 | failed |")
    lines = [head, "|---|" + "---:|" * (9 if later else 8)]

    def p(stats: dict | None, q: str):
        return stats["percentiles"].get(q) if stats else None

    for name, rate, m in _rows(results):
        total = m["completed"] + m["failed"]
        good_pct = 100.0 * m["good_requests"] / total if total else float("nan")
        t2 = (later or {}).get((name, rate))
        lines.append(
            f"| {name} | {rate} | {f(m['request_throughput'], 2)} | {f(m['output_throughput'], 1)} | "
            f"{f(m['goodput'], 2)} ({f(good_pct)}%) | {f(p(m['ttft'], 'p50'))} / {f(p(m['ttft'], 'p99'))} | "
            + (f"{f(p(t2, 'p50'))} / {f(p(t2, 'p99'))} | " if later else "")
            + f"{f(p(m['tpot'], 'p50'))} / {f(p(m['tpot'], 'p99'))} | {f(p(m['itl'], 'p50'))} / {f(p(m['itl'], 'p99'))} | "
            f"{f(m['itl_p99_over_p50'], 2)} | {m['failed']} |")
    return "\n".join(lines)


def summary_table(results: dict, slo: SLO) -> str:
    """The terminal's view of the sweep: the SLO said once, then one aligned row per deployment and rate."""
    def f(x, digits=0):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"

    later = _later_turns(results)
    rows = [("deployment", "rate req/s", "achieved req/s", "goodput req/s", "TTFT p50 ms", "TTFT p99 ms",
             *(("TTFT>=2 p50 ms", "TTFT>=2 p99 ms") if later else ()), "TPOT p50 ms", "ITL p99/p50", "failed")]
    for name, rate, m in _rows(results):
        total = m["completed"] + m["failed"]
        good = f"{f(m['goodput'], 2)} ({f(100.0 * m['good_requests'] / total) if total else '-'}%)"
        ttft, tpot = m["ttft"]["percentiles"], m["tpot"]["percentiles"]
        t2 = ((later or {}).get((name, rate)) or {}).get("percentiles", {})
        rows.append((name, str(rate), f(m["request_throughput"], 2), good, f(ttft.get("p50")), f(ttft.get("p99")),
                     *((f(t2.get("p50")), f(t2.get("p99"))) if later else ()),
                     f(tpot.get("p50")), f(m["itl_p99_over_p50"], 2), str(m["failed"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [slo.describe() + " (the % is of the requests sent)"]
    for r in rows:
        lines.append("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]))
    return "\n".join(lines)


def _verdict(ok: bool, why: str = "") -> str:
    return ("met" if ok else "missed") + (f" ({why})" if why else "")


def target_checks(results: dict, cfg: SweepConfig) -> list[str]:
    """The issue's targets, per offered rate: 1P1D goodput >= co-located and >= 3x transformers;
    1P1D ITL p99/p50 <= 1.5 at the highest rate (the most prefill-heavy load); then the targets against vLLM."""
    deps = results["deployments"]
    by = {n: {r["request_rate"]: r["metrics"] for r in d["runs"]} for n, d in deps.items()}
    disagg = next((n for n in by if _DISAGG.match(n)), None)
    if disagg is None:
        return ["targets: no disaggregated deployment in this sweep"] + vllm_checks(by)
    return _disagg_checks(by, disagg) + vllm_checks(by)


def vllm_checks(by: dict[str, dict[str, dict]]) -> list[str]:
    """Issue [8]'s targets against vLLM's CPU backend, per offered rate: co-located goodput >= 1.2x vLLM's,
    NpMd goodput >= vLLM's (2% slack for a tie, as above)."""
    if "vllm" not in by:
        return []
    out = []
    for rate, v in by["vllm"].items():
        parts = [f"rate {rate}: vllm goodput {v['goodput']:.2f} req/s"]
        for name in by:
            if name == "vllm" or rate not in by[name] or not (_COLOCATED.match(name) or _DISAGG.match(name)):
                continue
            g, need = by[name][rate]["goodput"], 1.2 if _COLOCATED.match(name) else 1.0
            if g == 0 == v["goodput"]:
                verdict = _verdict(False, "both 0")
            elif g >= 0.98 * need * v["goodput"]:
                verdict = _verdict(True)
            elif need * v["goodput"] > v["request_throughput"] * 1.02:
                verdict = _verdict(False, "unreachable: vllm serves the offered load within the SLO")
            else:
                verdict = _verdict(False)
            parts.append(f"{name} {g:.2f}, target >= {need:g}x vllm: {verdict}")
        out.append("; ".join(parts))
    return out


def _disagg_checks(by: dict[str, dict[str, dict]], disagg: str) -> list[str]:
    out = []
    for rate, m in by[disagg].items():
        parts = [f"rate {rate}: {disagg} goodput {m['goodput']:.2f} req/s"]
        if "colocated" in by and rate in by["colocated"]:
            # 2% slack: the same number of good requests over windows a few ms apart is a tie.
            c = by["colocated"][rate]["goodput"]
            parts.append(f"target >= colocated ({c:.2f}): {_verdict(m['goodput'] >= 0.98 * c)}")
        if "transformers" in by and rate in by["transformers"]:
            t = by["transformers"][rate]["goodput"]
            if t > 0:
                ratio = m["goodput"] / t
                parts.append(f"target >= 3x transformers ({t:.2f}): {_verdict(ratio >= 3, f'{ratio:.1f}x')}")
            else:
                parts.append(f"target >= 3x transformers (0.00): "
                             f"{_verdict(m['goodput'] > 0, '' if m['goodput'] > 0 else 'both 0')}")
        out.append("; ".join(parts))
    last = list(by[disagg])[-1]
    ratio = by[disagg][last]["itl_p99_over_p50"]
    if ratio is None or (isinstance(ratio, float) and math.isnan(ratio)):
        out.append(f"{disagg} at rate {last}: target ITL p99/p50 <= 1.5: not measured")
    else:
        out.append(f"{disagg} at rate {last}: target ITL p99/p50 <= 1.5: {_verdict(ratio <= 1.5, f'{ratio:.2f}')}")
    return out


def _plots(results: dict, out: Path) -> list[Path]:
    series = {name: [(_rate(r["request_rate"]), r["metrics"]) for r in d["runs"]]
              for name, d in results["deployments"].items()}
    made = []
    if series:
        p = plots.plot_vs_rate(series, out.with_suffix(".rates.png"), title="Tandem vs request rate")
        made.append(p)
        cdfs = {}
        for name, d in results["deployments"].items():
            if d["runs"] and "requests" in d["runs"][-1]:
                cdfs[f"{name} @ {d['runs'][-1]['request_rate']}"] = cdf_values(d["runs"][-1]["requests"])
        if cdfs:
            made.append(plots.plot_cdfs(cdfs, out.with_suffix(".cdf.png"), title="latency CDFs at the highest rate"))
        if "capacity" in results:
            tried = {name: [(_rate(r["request_rate"]), r["slo_attainment"]) for r in d["runs"]]
                     for name, d in results["deployments"].items()}
            goal = results["config"]["capacity"]["goal"]
            made.append(plots.plot_capacity(tried, goal, out.with_suffix(".capacity.png"), title="capacity at SLO"))
    return [p for p in made if p is not None]


def _rate(label: str) -> float:
    return math.inf if label == "inf" else float(label)
