"""Arrival schedules, the concurrency cap and warm-ups, with a fake backend (no server)."""

import asyncio
import math
import random
import statistics
import time

import pytest

from tandem.bench.serve.records import BenchRequest, RequestRecord
from tandem.bench.serve.runner import LoadConfig, WarmupFailed, arrival_offsets, run_load


class FakeBackend:
    """Answers every request with `tokens` tokens, `gap` seconds apart; fails prompts starting with 'x'."""

    def __init__(self, tokens: int = 3, gap: float = 0.005):
        self.tokens, self.gap = tokens, gap
        self.in_flight = self.max_in_flight = 0
        self.sent: list[str] = []

    async def start(self): ...

    async def close(self): ...

    async def send(self, req: BenchRequest) -> RequestRecord:
        self.sent.append(req.prompt)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        rec = RequestRecord(prompt_len=req.prompt_len, output_len=req.output_len, start=time.perf_counter())
        try:
            if req.prompt.startswith("x"):
                rec.error = "INVALID_ARGUMENT: bad prompt"
                return rec
            for _ in range(self.tokens):
                await asyncio.sleep(self.gap)
                rec.token_times.append(time.perf_counter())
            rec.output_tokens, rec.success = self.tokens, True
            return rec
        finally:
            rec.end = time.perf_counter()
            self.in_flight -= 1


def reqs(n, prefix="p"):
    return [BenchRequest(prompt=f"{prefix}{i}", prompt_len=4, output_len=3) for i in range(n)]


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, math.inf, 1.0, random.Random(0)) == [0.0] * 5


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_keep_the_mean_rate_and_set_the_variability(burstiness):
    offsets = arrival_offsets(20001, 4.0, burstiness, random.Random(0))
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.25, rel=0.05)
    cv2 = statistics.pvariance(gaps) / mean**2          # gamma(k): CV^2 = 1 / k; Poisson: 1
    assert cv2 == pytest.approx(1.0 / burstiness, rel=0.15)
    assert arrival_offsets(10, 4.0, burstiness, random.Random(0)) == offsets[:10]


def test_load_config_validation():
    for bad in (dict(request_rate=0), dict(burstiness=0), dict(max_concurrency=0)):
        with pytest.raises(ValueError):
            LoadConfig(**bad)


def test_concurrency_cap_and_warmups_are_not_measured():
    backend = FakeBackend()
    result = asyncio.run(run_load(backend, reqs(12), LoadConfig(max_concurrency=3), warmups=reqs(2, "w")))
    assert backend.sent[:2] == ["w0", "w1"]
    assert backend.max_in_flight == 3
    assert len(result.records) == 12 and all(r.success for r in result.records)
    assert len(result.warmups) == 2
    assert result.duration_s >= max(r.end for r in result.records) - result.t0 - 1e-9


def test_requests_follow_the_arrival_schedule():
    load = LoadConfig(request_rate=100.0, seed=5)
    result = asyncio.run(run_load(FakeBackend(tokens=1), reqs(10), load))
    offsets = arrival_offsets(10, 100.0, 1.0, random.Random(5))
    for rec, at in zip(result.records, offsets, strict=True):
        assert rec.start - result.t0 >= at - 1e-3  # never early
    assert result.records[-1].start - result.t0 == pytest.approx(offsets[-1], abs=0.05)


def test_failed_requests_are_recorded_not_raised():
    result = asyncio.run(run_load(FakeBackend(), reqs(3) + reqs(2, "x"), LoadConfig()))
    assert [r.success for r in result.records] == [True, True, True, False, False]
    assert result.records[-1].error == "INVALID_ARGUMENT: bad prompt"


def test_all_warmups_failing_stops_the_run():
    backend = FakeBackend()
    with pytest.raises(WarmupFailed, match="bad prompt"):
        asyncio.run(run_load(backend, reqs(3), LoadConfig(), warmups=reqs(2, "x")))
    assert backend.sent == ["x0", "x1"]
