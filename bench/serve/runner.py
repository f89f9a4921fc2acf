"""When requests are sent: an arrival schedule, an optional concurrency cap, warm-ups first."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.bench.serve.backends import Backend
from tandem.bench.serve.records import BenchRequest, RequestRecord


class WarmupFailed(RuntimeError):
    """Every warm-up request failed: the server is down or rejects this workload."""


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf       # mean arrivals per second; inf = all at once
    burstiness: float = 1.0              # gamma shape: 1 = Poisson, < 1 burstier, > 1 steadier
    max_concurrency: int | None = None   # at most this many requests in flight (None = no cap)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be > 0 (inf for all at once), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max concurrency must be >= 1")


def arrival_offsets(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Send times (s from the start) of n requests; the first goes at 0.

    Gaps are gamma-distributed with shape `burstiness` and mean 1 / rate, so burstiness 1 is a
    Poisson process, and the mean rate is the same whatever the burstiness.
    """
    if math.isinf(rate):
        return [0.0] * n
    scale = 1.0 / (rate * burstiness)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, scale)
    return out


@dataclass
class RunResult:
    records: list[RequestRecord]
    warmups: list[RequestRecord]
    t0: float                             # perf_counter at the schedule's start
    duration_s: float                     # t0 -> last request finished


async def run_warmups(backend: Backend, warmups: Sequence[BenchRequest]) -> list[RequestRecord]:
    """One at a time, so a server that configures itself from its first request (transformers'
    continuous batching) sees the benchmark's settings; raises WarmupFailed if none succeeds."""
    records = [await backend.send(w) for w in warmups]
    if records and not any(r.success for r in records):
        raise WarmupFailed(f"all {len(records)} warm-up requests failed; first error: {records[0].error}")
    return records


async def run_load(backend: Backend, requests: Sequence[BenchRequest], load: LoadConfig,
                   warmups: Sequence[BenchRequest] = (), progress: bool = False, desc: str = "",
                   offsets: Sequence[float] | None = None) -> RunResult:
    """`offsets`: the send times (s from the start) of `requests`, e.g. a load profile's; default: drawn
    from `load`'s rate and burstiness."""
    warm = await run_warmups(backend, warmups)
    if offsets is None:
        offsets = arrival_offsets(len(requests), load.request_rate, load.burstiness, random.Random(load.seed))
    sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    bar = _progress_bar(len(requests), desc, progress)

    async def one(req: BenchRequest, at: float) -> RequestRecord:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is None:
            rec = await backend.send(req)
        else:
            async with sem:
                rec = await backend.send(req)
        rec.phase = req.phase
        bar.update(1)
        return rec

    t0 = time.perf_counter()
    try:
        records = list(await asyncio.gather(*(one(r, at) for r, at in zip(requests, offsets, strict=True))))
    finally:
        bar.close()
    end = max((r.end for r in records), default=t0)
    return RunResult(records=records, warmups=warm, t0=t0, duration_s=max(end - t0, 1e-9))


def _progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc or "requests", unit="req", disable=not enabled, leave=False,
                dynamic_ncols=True)
