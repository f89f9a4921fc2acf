"""Where TTFT goes, from the spans of the file exporter (`--otlp-traces-endpoint file:///path`):
per request, the time of each phase on the way to the first token, then p50/p99 per phase.

    python -m tandem.bench.trace_breakdown traces.jsonl [--since-ns N] [--out breakdown.json]

`tandem bench serve --trace-file` prints and stores the same table for its run. The phases (see
docs/observability.md#tracing) follow one request through a disaggregated stack; those of a
co-located or local-prefill request are missing and left out of its sum. With retries, the last
attempt's spans count.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence

from tandem.bench.flags import add_out_flag
from tandem.bench.results import write_result
from tandem.cli.trace_cmd import load

# phase -> the span whose duration it is ("a->b": from the start of a to the start of b)
PHASES: dict[str, str] = {
    "gateway": "POST /v1/completions|POST /v1/chat/completions->router.generate",
    "router_queue": "router.queue",
    "route": "router.queue>router.attempt",
    "prefill_wait_bootstrap": "prefill.wait_bootstrap",
    "prefill_queue": "prefill.queue",
    "prefill_compute": "prefill.chunk*",
    "kv_transfer_tail": "prefill.kv_transfer",
    "decode_admission": "decode.admission",
    "decode_wait_kv": "decode.wait_kv",
    "decode_first_token": "decode.first_token",
}


def _last(spans: Sequence[dict], names: str) -> dict | None:
    found = [s for s in spans if s["name"] in names.split("|")]
    return max(found, key=lambda s: s["start_ns"]) if found else None


def phases_of(spans: Sequence[dict]) -> dict[str, float]:
    """One trace's phases in ms (only those it has), plus `ttft`: root start -> first token."""
    out: dict[str, float] = {}
    for phase, spec in PHASES.items():
        if "->" in spec:            # start of a to start of b
            a, b = (_last(spans, n) for n in spec.split("->"))
            if a and b:
                out[phase] = (b["start_ns"] - a["start_ns"]) / 1e6
        elif ">" in spec:           # end of a to start of b
            a, b = (_last(spans, n) for n in spec.split(">"))
            if a and b:
                out[phase] = (b["start_ns"] - a["end_ns"]) / 1e6
        elif spec.endswith("*"):    # first start to last end of every such span (the last attempt's)
            chunks = [s for s in spans if s["name"] == spec[:-1]]
            if chunks:
                out[phase] = (max(s["end_ns"] for s in chunks) - min(s["start_ns"] for s in chunks)) / 1e6
        elif (s := _last(spans, spec)) is not None:
            out[phase] = (s["end_ns"] - s["start_ns"]) / 1e6
    ids = {s["span_id"] for s in spans}
    roots = [s for s in spans if s["parent_id"] not in ids]
    first = _last(spans, "decode.first_token")
    if roots and first:
        out["ttft"] = (first["end_ns"] - min(r["start_ns"] for r in roots)) / 1e6
    return out


def percentile(values: Sequence[float], q: float) -> float:
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (k - lo)


def breakdown(traces: Mapping[str, Sequence[dict]], since_ns: int = 0) -> dict:
    """p50/p99 (ms) and count per phase over the traces that reached a first token after `since_ns`."""
    per = [phases_of(spans) for spans in traces.values() if min(s["start_ns"] for s in spans) >= since_ns]
    per = [p for p in per if "ttft" in p]
    table = {}
    for phase in [*PHASES, "ttft"]:
        values = [p[phase] for p in per if phase in p]
        if values:
            table[phase] = {"p50_ms": percentile(values, 50), "p99_ms": percentile(values, 99), "n": len(values)}
    return {"requests": len(per), "phases": table}


def format_table(result: dict) -> list[str]:
    lines = [f"TTFT breakdown over {result['requests']} traced requests", f"{'phase':<24}{'p50 ms':>10}{'p99 ms':>10}"]
    for phase, row in result["phases"].items():
        lines.append(f"{phase:<24}{row['p50_ms']:10.2f}{row['p99_ms']:10.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.trace_breakdown", description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="spans file of --otlp-traces-endpoint file:///path")
    p.add_argument("--since-ns", type=int, default=0, help="only traces that started at or after (epoch ns)")
    add_out_flag(p, help="also write the table as JSON")
    args = p.parse_args(argv)
    result = breakdown(load(args.file), args.since_ns)
    print("\n".join(format_table(result)))
    if args.out:
        write_result(args.out, result, tool="tandem.bench.trace_breakdown")
    return 0 if result["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
