"""Metric computations against hand-computed examples (no torch, no servers)."""

import random

import numpy as np
import pytest

from tandem.bench.serve.metrics import (
    SLO,
    LatencyStats,
    compute_metrics,
    format_priority_summary,
    format_summary,
    metrics_by_priority,
    percentile,
)
from tandem.bench.serve.records import RequestRecord


def rec(start, times, end, out_tokens, prompt_len=10, error=""):
    return RequestRecord(prompt_len=prompt_len, output_len=out_tokens, start=start, end=end,
                         token_times=list(times), output_tokens=out_tokens, success=not error, error=error)


# A: TTFT 100 ms, gaps 200/100/300 ms, 4 tokens -> TPOT (700 - 100) / 3 = 200 ms
# B: TTFT 500 ms, gap 100 ms, 2 tokens, stream ends 100 ms after the last token -> TPOT 200 ms
# C: one token at 200 ms: no ITL, no TPOT
# D: failed
A = dict(start=0.0, times=[0.1, 0.3, 0.4, 0.7], end=0.7, out_tokens=4, prompt_len=10)
B = dict(start=1.0, times=[1.5, 1.6], end=1.7, out_tokens=2, prompt_len=20)
C = dict(start=2.0, times=[2.2], end=2.2, out_tokens=1, prompt_len=0)


def records():
    return [rec(**A), rec(**B), rec(**C),
            rec(start=3.0, times=[], end=3.1, out_tokens=0, prompt_len=5, error="HTTP 500: boom")]


def test_per_request_ttft_itl_tpot_e2e():
    a, b, c, d = records()
    assert a.ttft == pytest.approx(0.1) and a.e2e == pytest.approx(0.7)
    assert a.itl == pytest.approx([0.2, 0.1, 0.3])
    assert a.tpot == pytest.approx(0.2)
    assert b.ttft == pytest.approx(0.5) and b.tpot == pytest.approx(0.2)
    assert c.ttft == pytest.approx(0.2) and c.itl == [] and c.tpot is None
    assert d.ttft is None and d.tpot is None


@pytest.mark.parametrize("values,p,expected", [
    ([1, 2, 3, 4], 50, 2.5),
    ([1, 2, 3, 4], 0, 1),
    ([1, 2, 3, 4], 100, 4),
    ([1, 2, 3, 4], 25, 1.75),
    ([4, 1, 3, 2], 90, 3.7),           # unsorted input; rank 2.7 -> 3 + 0.7 * 1
    ([100, 500, 200], 99, 494),        # rank 1.98 -> 200 + 0.98 * 300
    ([7], 99, 7),
])
def test_percentile_by_hand(values, p, expected):
    assert percentile(values, p) == pytest.approx(expected)


def test_percentile_matches_numpy_linear():
    rng = random.Random(0)
    for n in (2, 3, 10, 101):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for p in (1, 50, 90, 99, 99.9):
            assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))


def test_percentile_rejects_empty_and_out_of_range():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_aggregate_metrics_by_hand():
    m = compute_metrics(records(), duration_s=4.0)
    assert (m.completed, m.failed) == (3, 1)
    assert m.failures == {"HTTP 500: boom": 1}
    assert m.total_input_tokens == 30 and m.total_output_tokens == 7  # failed requests count nothing
    assert m.request_throughput == pytest.approx(0.75)
    assert m.output_throughput == pytest.approx(1.75)
    assert m.total_token_throughput == pytest.approx(37 / 4)
    # TTFT ms: 100, 500, 200
    assert m.ttft.n == 3
    assert m.ttft.mean == pytest.approx(800 / 3)
    assert m.ttft.p(50) == pytest.approx(200)
    assert m.ttft.p(90) == pytest.approx(440)   # rank 1.8 -> 200 + 0.8 * 300
    assert m.ttft.p(99) == pytest.approx(494)
    assert (m.ttft.min, m.ttft.max) == pytest.approx((100, 500))
    # ITL pooled over requests, ms: 200, 100, 300 (A) + 100 (B) -> sorted 100, 100, 200, 300
    assert m.itl.n == 4 and m.itl.mean == pytest.approx(175)
    assert m.itl.p(50) == pytest.approx(150)
    assert m.itl.p(90) == pytest.approx(270)
    assert m.itl.p(99) == pytest.approx(297)
    assert m.itl_p99_over_p50 == pytest.approx(297 / 150)
    # TPOT only for requests with >= 2 tokens: A and B, both 200 ms
    assert m.tpot.n == 2 and m.tpot.p(50) == pytest.approx(200) and m.tpot.std == pytest.approx(0)
    # E2E ms: 700, 700, 200
    assert m.e2e.mean == pytest.approx(1600 / 3) and m.e2e.p(50) == pytest.approx(700)
    # no SLO: every completed request is good
    assert m.goodput == pytest.approx(0.75) and m.good_requests == 3


@pytest.mark.parametrize("slo,good", [
    ("ttft=300ms,tpot=150ms", 1),   # A fails TPOT (200), B fails TTFT (500), C passes (no TPOT)
    ("ttft=300ms", 2),              # A, C
    ("tpot=250ms", 3),              # all completed; the failed one never counts
    ("tpot=200ms", 3),              # the bound is inclusive
    ("e2e=0.5s", 1),                # C only
    ("ttft=0.05s", 0),
])
def test_goodput_by_hand(slo, good):
    m = compute_metrics(records(), duration_s=4.0, slo=SLO.parse(slo))
    assert m.good_requests == good
    assert m.goodput == pytest.approx(good / 4.0)


@pytest.mark.parametrize("text,expected", [
    ("ttft=2s,tpot=150ms", SLO(ttft=2.0, tpot=0.15)),
    ("ttft=2000", SLO(ttft=2.0)),               # bare numbers are milliseconds (vLLM's --goodput)
    ("TTFT:500, e2e=1.5s", SLO(ttft=0.5, e2e=1.5)),
    ("", SLO()),
])
def test_slo_parse(text, expected):
    got = SLO.parse(text)
    for field in ("ttft", "tpot", "e2e"):
        want = getattr(expected, field)
        assert getattr(got, field) == (None if want is None else pytest.approx(want)), field


@pytest.mark.parametrize("text", ["foo=1", "ttft=abc", "ttft", "tpot=-5ms"])
def test_slo_parse_rejects(text):
    with pytest.raises(ValueError):
        SLO.parse(text)


def test_empty_distribution_and_summary_text():
    assert LatencyStats.of([]).n == 0
    m = compute_metrics([rec(start=0, times=[], end=1, out_tokens=0, error="UNAVAILABLE: down")], duration_s=1.0)
    assert m.completed == 0 and m.goodput == 0
    text = format_summary(m, "t")
    assert "UNAVAILABLE: down" in text and "Failed requests" in text


def test_record_json_in_ms_relative_to_start():
    d = rec(**B).to_dict(t0=0.5)
    assert d["sent_ms"] == pytest.approx(500)
    assert d["ttft_ms"] == pytest.approx(500) and d["tpot_ms"] == pytest.approx(200)
    assert d["itl_ms"] == pytest.approx([100]) and d["e2e_ms"] == pytest.approx(700)


def test_cached_token_ratio_counts_successful_requests_only():
    a, b = rec(0.0, [0.1, 0.2], 0.2, 2, prompt_len=100), rec(0.0, [0.1], 0.1, 1, prompt_len=300)
    a.cached_tokens, b.cached_tokens = 80, 0
    failed = rec(0.0, [], 0.1, 0, prompt_len=1000, error="boom")
    failed.cached_tokens = 1000
    m = compute_metrics([a, b, failed], duration_s=1.0)
    assert m.cached_token_ratio == pytest.approx(0.2)
    assert "Cached prompt tokens (reported)" in format_summary(m, "x")


def test_metrics_by_priority_class_over_the_same_window():
    recs = records()
    assert metrics_by_priority(recs, 4.0) == {} and format_priority_summary({}) == ""
    for r, p in zip(recs, (0, 10, 0, 10), strict=True):
        r.priority = p
    by = metrics_by_priority(recs, 4.0, SLO(ttft=0.25))
    assert list(by) == [10, 0]                           # highest value first
    assert by[10].completed == 1 and by[10].failed == 1 and by[10].ttft.percentiles["p50"] == pytest.approx(500)
    assert by[0].completed == 2 and by[0].ttft.percentiles["p50"] == pytest.approx(150)
    assert by[0].good_requests == 2 and by[0].goodput == pytest.approx(0.5)   # A and C (100, 200 ms) within 250 ms
    assert by[10].duration_s == by[0].duration_s == 4.0
    text = format_priority_summary(by)
    assert "priority   10" in text and "3.33x the lowest class" in text and "1.00x" in text
