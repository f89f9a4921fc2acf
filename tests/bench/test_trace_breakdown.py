"""bench/trace_breakdown.py: one request's phases from its spans, and the percentiles over requests."""

from __future__ import annotations

from tandem.bench.trace_breakdown import breakdown, phases_of

MS = 1_000_000


def span(name: str, sid: str, parent: str | None, start_ms: float, end_ms: float, trace: str = "t1") -> dict:
    return {"trace_id": trace, "span_id": sid, "parent_id": parent, "name": name, "service": "s",
            "start_ns": int(start_ms * MS), "end_ns": int(end_ms * MS), "attributes": {}}


def request(trace: str, shift: float = 0.0) -> list[dict]:
    s = [("POST /v1/completions", "g", "client", 0, 100), ("router.generate", "r", "g", 2, 99),
         ("router.queue", "q", "r", 2, 5), ("router.attempt", "a", "r", 6, 99),
         ("tandem.prefill", "p", "a", 7, 40), ("prefill.queue", "pq", "p", 8, 10),
         ("prefill.chunk", "c0", "p", 10, 20), ("prefill.chunk", "c1", "p", 20, 30 + shift),
         ("prefill.kv_transfer", "kv", "p", 30 + shift, 35 + shift), ("tandem.decode", "d", "a", 7, 98),
         ("decode.admission", "da", "d", 7, 9), ("decode.wait_kv", "dw", "d", 9, 36 + shift),
         ("decode.first_token", "df", "d", 36 + shift, 40 + shift)]
    return [span(*x, trace=trace) for x in s]


def test_phases_of_one_request():
    p = phases_of(request("t1"))
    assert p["gateway"] == 2 and p["router_queue"] == 3 and p["route"] == 1
    assert p["prefill_queue"] == 2 and p["prefill_compute"] == 20 and p["kv_transfer_tail"] == 5
    assert p["decode_admission"] == 2 and p["decode_wait_kv"] == 27 and p["decode_first_token"] == 4
    assert p["ttft"] == 40
    assert "prefill_wait_bootstrap" not in p        # a phase a request lacks is left out


def test_breakdown_percentiles_and_since():
    traces = {f"t{i}": request(f"t{i}", shift=float(i)) for i in range(11)}
    out = breakdown(traces)
    assert out["requests"] == 11
    assert out["phases"]["prefill_compute"]["p50_ms"] == 25 and out["phases"]["ttft"]["p99_ms"] > 49
    assert out["phases"]["router_queue"]["n"] == 11
    assert breakdown(traces, since_ns=1)["requests"] == 0   # every trace started at 0
