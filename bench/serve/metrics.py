"""Serving metrics from client-side request records. Pure Python: no numpy, no torch.

Definitions (all measured at the client):
- TTFT: request sent -> first token event.
- ITL: gaps between consecutive token events of one request, pooled over all requests.
- TPOT: per request, (E2E - TTFT) / (output tokens - 1); requests with one output token have none.
- E2E: request sent -> stream finished.
- Throughput: completed requests (or tokens) / duration of the measured window.
- Goodput: completed requests that meet every SLO given / duration. A request without a TPOT
  (one output token) meets any TPOT SLO.
Percentiles interpolate linearly between closest ranks (numpy's default "linear" method).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from tandem.bench.serve.records import RequestRecord

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) of `values`, linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    rank = p / 100.0 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@dataclass(frozen=True)
class LatencyStats:
    """Summary of one latency distribution, in milliseconds."""

    n: int
    mean: float
    std: float
    min: float
    max: float
    percentiles: dict[str, float]  # "p50" -> ms

    @classmethod
    def of(cls, seconds: Sequence[float], ps: Sequence[float] = DEFAULT_PERCENTILES) -> LatencyStats:
        if not seconds:
            nan = float("nan")
            return cls(0, nan, nan, nan, nan, {_pname(p): nan for p in ps})
        ms = [s * 1e3 for s in seconds]
        mean = sum(ms) / len(ms)
        std = math.sqrt(sum((x - mean) ** 2 for x in ms) / len(ms))
        return cls(len(ms), mean, std, min(ms), max(ms), {_pname(p): percentile(ms, p) for p in ps})

    def p(self, q: float) -> float:
        return self.percentiles[_pname(q)]


def _pname(p: float) -> str:
    return f"p{p:g}"


_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")


@dataclass(frozen=True)
class SLO:
    """Service-level objectives for goodput, in seconds; None = not constrained."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> SLO:
        """'ttft=2s,tpot=150ms' (a bare number is milliseconds, e.g. 'ttft=2000'); '' = no SLO."""
        if not text:
            return cls()
        values: dict[str, float] = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            if not sep:
                key, sep, value = part.partition(":")
            key = key.strip().lower()
            if not sep or key not in ("ttft", "tpot", "e2e"):
                raise ValueError(f"bad SLO {part!r}: expected ttft=..., tpot=... or e2e=... (e.g. ttft=2s,tpot=150ms)")
            m = _DURATION.match(value)
            if m is None:
                raise ValueError(f"bad SLO value {value!r} for {key}: expected e.g. 2s, 150ms or 150 (ms)")
            values[key] = float(m.group(1)) * (1.0 if m.group(2) == "s" else 1e-3)
        return cls(**values)

    @property
    def empty(self) -> bool:
        return self.ttft is None and self.tpot is None and self.e2e is None

    def met(self, r: RequestRecord) -> bool:
        if not r.success:
            return False
        if self.ttft is not None and (r.ttft is None or r.ttft > self.ttft):
            return False
        if self.tpot is not None and r.tpot is not None and r.tpot > self.tpot:
            return False
        return self.e2e is None or r.e2e <= self.e2e

    def __str__(self) -> str:
        parts = [f"{k}<={v * 1e3:g}ms" for k, v in (("ttft", self.ttft), ("tpot", self.tpot), ("e2e", self.e2e))
                 if v is not None]
        return ",".join(parts) or "none"

    def describe(self) -> str:
        """What goodput counts, in words, for a header line."""
        parts = [f"{k} <= {v * 1e3:g} ms" for k, v in (("TTFT", self.ttft), ("TPOT", self.tpot), ("E2E", self.e2e))
                 if v is not None]
        if not parts:
            return "goodput = completed requests/s (no SLO)"
        return "goodput = requests/s that completed with " + " and ".join(parts)


@dataclass(frozen=True)
class BenchMetrics:
    duration_s: float
    completed: int
    failed: int
    failures: dict[str, int]          # error message -> count
    total_input_tokens: int
    total_output_tokens: int
    cached_token_ratio: float         # prompt tokens served from prefix caches / prompt tokens (as reported)
    request_throughput: float         # completed req/s
    output_throughput: float          # output tok/s
    total_token_throughput: float     # (input + output) tok/s
    slo: str
    good_requests: int
    goodput: float                    # req/s meeting the SLO (= request_throughput without an SLO)
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats

    @property
    def itl_p99_over_p50(self) -> float:
        p50 = self.itl.percentiles.get("p50", float("nan"))
        p99 = self.itl.percentiles.get("p99", float("nan"))
        return p99 / p50 if p50 > 0 else float("nan")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["itl_p99_over_p50"] = self.itl_p99_over_p50
        return d


def compute_metrics(records: Sequence[RequestRecord], duration_s: float, slo: SLO = SLO(),
                    percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> BenchMetrics:
    assert duration_s > 0, "the measured window must have a positive duration"
    ok = [r for r in records if r.success]
    failures = Counter(r.error or "unknown error" for r in records if not r.success)
    in_tokens = sum(r.prompt_len for r in ok)
    out_tokens = sum(r.output_tokens for r in ok)
    good = sum(1 for r in ok if slo.met(r))
    return BenchMetrics(
        duration_s=duration_s,
        completed=len(ok),
        failed=len(records) - len(ok),
        failures=dict(failures.most_common()),
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        cached_token_ratio=sum(r.cached_tokens for r in ok) / in_tokens if in_tokens else 0.0,
        request_throughput=len(ok) / duration_s,
        output_throughput=out_tokens / duration_s,
        total_token_throughput=(in_tokens + out_tokens) / duration_s,
        slo=str(slo),
        good_requests=good,
        goodput=good / duration_s,
        ttft=LatencyStats.of([r.ttft for r in ok if r.ttft is not None], percentiles),
        tpot=LatencyStats.of([r.tpot for r in ok if r.tpot is not None], percentiles),
        itl=LatencyStats.of([x for r in ok for x in r.itl], percentiles),
        e2e=LatencyStats.of([r.e2e for r in ok], percentiles),
    )


def metrics_by_priority(records: Sequence[RequestRecord], duration_s: float, slo: SLO = SLO(),
                        percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[int, BenchMetrics]:
    """One `BenchMetrics` per priority class over the same window, most urgent-looking (highest
    value) first; {} when the workload sent no priorities."""
    classes = sorted({r.priority for r in records if r.priority is not None}, reverse=True)
    return {p: compute_metrics([r for r in records if r.priority == p], duration_s, slo, percentiles)
            for p in classes}


def format_priority_summary(by_priority: dict[int, BenchMetrics]) -> str:
    """A line per class: requests, goodput, TTFT and E2E p50, and TTFT p50 against the last
    (lowest-valued) class's."""
    if not by_priority:
        return ""
    base = list(by_priority.values())[-1].ttft.percentiles.get("p50", float("nan"))
    lines = []
    for p, m in by_priority.items():
        ttft = m.ttft.percentiles.get("p50", float("nan"))
        rel = ttft / base if base > 0 else float("nan")
        lines.append(f"priority {p:>4d}: {m.completed:>4d} ok, {m.failed} failed, goodput {m.goodput:.3f}, "
                     f"TTFT p50 {ttft:.1f} ms ({rel:.2f}x the lowest class), "
                     f"E2E p50 {m.e2e.percentiles.get('p50', float('nan')):.1f} ms")
    return "\n".join(lines)


def format_summary(m: BenchMetrics, title: str, slo: SLO | None = None) -> str:
    """A human-readable block for the terminal (`slo`: what goodput counted, said in words)."""
    rows = [
        ("Successful requests", f"{m.completed}"),
        ("Failed requests", f"{m.failed}"),
        ("Duration (s)", f"{m.duration_s:.2f}"),
        ("Request throughput (req/s)", f"{m.request_throughput:.3f}"),
        ("Output token throughput (tok/s)", f"{m.output_throughput:.1f}"),
        ("Total token throughput (tok/s)", f"{m.total_token_throughput:.1f}"),
        ("Goodput (req/s)", f"{m.goodput:.3f} ({m.good_requests} requests)"),
        ("Cached prompt tokens (reported)", f"{m.cached_token_ratio:.1%}"),
    ]
    lines = [f"==== {title} ===="]
    if slo is not None:
        lines.append(slo.describe())
    lines += [f"{k:<42s}{v}" for k, v in rows]
    names = list(m.ttft.percentiles)
    lines.append(f"{'(ms)':<8s}{'mean':>10s}" + "".join(f"{n:>10s}" for n in names))
    for label, s in (("TTFT", m.ttft), ("TPOT", m.tpot), ("ITL", m.itl), ("E2E", m.e2e)):
        lines.append(f"{label:<8s}{s.mean:>10.1f}" + "".join(f"{s.percentiles[n]:>10.1f}" for n in names))
    lines.append(f"{'ITL p99/p50':<42s}{m.itl_p99_over_p50:.2f}")
    for msg, count in m.failures.items():
        lines.append(f"failure x{count}: {msg}")
    return "\n".join(lines)


@dataclass(frozen=True)
class TurnStats:
    """One turn index of a multi-turn run, over every conversation that got that far."""

    sent: int
    completed: int
    failed: int
    mean_prompt_len: float            # tokens, as the workload's tokenizer counts them (nan if none sent)
    ttft: LatencyStats                # of the completed turns


@dataclass(frozen=True)
class MultiTurnMetrics:
    """The multi-turn workload's own view: conversations, and TTFT of first turns apart from later
    ones (a later turn's prompt starts with a history the server may still hold)."""

    conversations: int
    turns: int                        # planned per conversation
    conversations_completed: int      # every turn succeeded
    conversations_failed: int         # ended by a failed turn
    turns_sent: int
    turns_not_sent: int               # the turns after a failed one
    ttft_turn_1: LatencyStats
    ttft_turns_2_plus: LatencyStats
    by_turn: dict[int, TurnStats]     # turn index (1-based) -> its stats

    def to_dict(self) -> dict:
        return asdict(self)


def multi_turn_metrics(records: Sequence[RequestRecord], conversations: int, turns: int,
                       percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> MultiTurnMetrics:
    """From the records of a multi-turn run (each with `conversation` and `turn` set); p50 and p99
    are always among the percentiles."""
    assert all(r.conversation is not None and r.turn is not None for r in records), "not a multi-turn run"
    ps = sorted(set(percentiles) | {50.0, 99.0})
    failed_convs = {r.conversation for r in records if not r.success}
    by_turn = {}
    for k in range(1, turns + 1):
        sent = [r for r in records if r.turn == k]
        ok = [r for r in sent if r.success]
        by_turn[k] = TurnStats(
            sent=len(sent), completed=len(ok), failed=len(sent) - len(ok),
            mean_prompt_len=sum(r.prompt_len for r in sent) / len(sent) if sent else float("nan"),
            ttft=LatencyStats.of([r.ttft for r in ok if r.ttft is not None], ps))

    def ttfts(first: bool) -> LatencyStats:
        return LatencyStats.of([r.ttft for r in records
                                if r.success and r.ttft is not None and (r.turn == 1) == first], ps)

    return MultiTurnMetrics(
        conversations=conversations, turns=turns,
        conversations_completed=conversations - len(failed_convs), conversations_failed=len(failed_convs),
        turns_sent=len(records), turns_not_sent=conversations * turns - len(records),
        ttft_turn_1=ttfts(first=True), ttft_turns_2_plus=ttfts(first=False), by_turn=by_turn)


def format_multi_turn_summary(m: MultiTurnMetrics) -> str:
    lines = [
        f"{'Conversations':<42s}{m.conversations} x {m.turns} turns: {m.conversations_completed} completed, "
        f"{m.conversations_failed} ended by a failed turn",
        f"{'Turns sent / not sent':<42s}{m.turns_sent} / {m.turns_not_sent}",
        f"{'(ms)':<16s}{'n':>6s}{'mean':>10s}{'p50':>10s}{'p99':>10s}",
    ]
    for label, s in (("TTFT turn 1", m.ttft_turn_1), ("TTFT turns >= 2", m.ttft_turns_2_plus)):
        lines.append(f"{label:<16s}{s.n:>6d}{s.mean:>10.1f}{s.p(50):>10.1f}{s.p(99):>10.1f}")
    lines.append("TTFT p50 by turn (ms): " + ", ".join(
        f"{k}: {t.ttft.p(50):.1f}" for k, t in m.by_turn.items()))
    return "\n".join(lines)
