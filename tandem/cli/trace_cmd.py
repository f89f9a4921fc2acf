"""`tandem trace FILE [--request-id ID]`: a request's timeline from the file exporter's spans
(`--otlp-traces-endpoint file:///path/traces.jsonl`), nested by parent, with start offsets and
durations. Without `--request-id`: the last complete trace in the file."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

SUMMARY = "print a request's span timeline from a trace file (--otlp-traces-endpoint file://...)"
# Attributes worth a column in the timeline.
KEY_ATTRIBUTES = ("gen_ai.request.model", "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
                  "gen_ai.request.max_tokens", "tandem.route", "tandem.route.policy", "tandem.route.prefill_worker",
                  "tandem.route.decode_worker", "tandem.attempt", "tandem.cached_tokens", "tandem.kv.bytes",
                  "tandem.kv.backend", "http.response.status_code", "tandem.status")


def load(path: str) -> dict[str, list[dict]]:
    """trace id -> its spans, from a file of JSON lines (a torn last line, being written, is skipped)."""
    traces: dict[str, list[dict]] = defaultdict(list)
    with open(path) as f:
        for line in f:
            try:
                span = json.loads(line)
            except json.JSONDecodeError:
                continue
            traces[span["trace_id"]].append(span)
    return dict(traces)


def find(traces: dict[str, list[dict]], request_id: str | None) -> list[dict] | None:
    """The spans of the trace whose `tandem.request_id` starts with `request_id` (gateway ids get a
    per-choice suffix), or of the last trace with a root span."""
    if request_id is not None:
        for spans in traces.values():
            if any(str(s["attributes"].get("tandem.request_id", "")).startswith(request_id) for s in spans):
                return spans
        return None
    ids = {s["span_id"] for spans in traces.values() for s in spans}
    rooted = [spans for spans in traces.values() if any(s["parent_id"] is None or s["parent_id"] not in ids
                                                        for s in spans)]
    return max(rooted, key=lambda spans: min(s["start_ns"] for s in spans)) if rooted else None


def timeline(spans: list[dict]) -> list[str]:
    """One line per span, children indented under their parent, ordered by start."""
    ids = {s["span_id"] for s in spans}
    children: dict[str | None, list[dict]] = defaultdict(list)
    for s in spans:
        children[s["parent_id"] if s["parent_id"] in ids else None].append(s)
    t0 = min(s["start_ns"] for s in spans)
    lines = [f"trace {spans[0]['trace_id']}", f"{'start ms':>9} {'dur ms':>9}  span"]

    def walk(parent: str | None, depth: int) -> None:
        for s in sorted(children[parent], key=lambda s: s["start_ns"]):
            attrs = " ".join(f"{k.split('.', 1)[-1] if k.startswith('tandem.') else k}={s['attributes'][k]}"
                             for k in KEY_ATTRIBUTES if k in s["attributes"])
            error = "  ERROR" if s.get("status") == "ERROR" else ""
            lines.append(f"{(s['start_ns'] - t0) / 1e6:9.2f} {(s['end_ns'] - s['start_ns']) / 1e6:9.2f}  "
                         f"{'  ' * depth}{s['name']} [{s['service']}]{error}  {attrs}".rstrip())
            walk(s["span_id"], depth + 1)

    walk(None, 0)
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="the spans file (--otlp-traces-endpoint file:///path/traces.jsonl)")
    p.add_argument("--request-id", help="the request (its id or the gateway's id prefix); default: the last one")


def run(args: argparse.Namespace) -> int:
    spans = find(load(args.file), args.request_id)
    if spans is None:
        print(f"no trace{' of request ' + args.request_id if args.request_id else ''} in {args.file}")
        return 1
    print("\n".join(timeline(spans)))
    return 0
