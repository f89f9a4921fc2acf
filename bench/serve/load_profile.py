"""`tandem bench serve --load-profile`: one run made of phases, each with its own length, request rate
and prompt/output lengths (a ramp, a mix change), and what it measured per phase and over time.

A profile is written `DURATION@RATE:IN/OUT,...`, e.g. `90s@0.5:128/256,120s@3:256/64,90s@1:1024/32`
(durations in s or m; a phase may be named, `burst=120s@3:256/64`), or is a JSON file: a list of
phases, or {"phases": [...]}, each {"name", "duration_s", "rate", "input_len", "output_len"}.

Arrivals follow the phase: within each phase, gaps are gamma-distributed with the phase's mean rate
(Poisson at burstiness 1, which is memoryless, so restarting at a phase boundary changes nothing);
the schedule and the prompts depend only on the seed, so every deployment gets the same trace.

Per phase, metrics are those of `compute_metrics` over the requests that *arrived* in the phase,
with the phase's length as the window: its goodput is its requests that met the SLO per second of
the phase (the phases' good requests add up to the whole run's). The time series counts, per window
of `window_s`, the requests sent, and the requests that completed, met the SLO or failed, by the
time they ended. Pure Python, torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.bench.serve.metrics import SLO, BenchMetrics, compute_metrics
from tandem.bench.serve.records import BenchRequest, RequestRecord


@dataclass(frozen=True)
class Phase:
    duration_s: float
    rate: float                          # mean arrivals per second (0: an idle phase)
    input_len: int
    output_len: int
    name: str = ""

    def __post_init__(self) -> None:
        if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise ValueError(f"a phase's duration must be > 0 s, got {self.duration_s}")
        if not (self.rate >= 0 and math.isfinite(self.rate)):
            raise ValueError(f"a phase's request rate must be finite and >= 0, got {self.rate}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"a phase's prompt and output lengths must be >= 1, got {self.input_len}/{self.output_len}")

    @property
    def spec(self) -> str:
        name = f"{self.name}=" if self.name else ""
        return f"{name}{self.duration_s:g}s@{self.rate:g}:{self.input_len}/{self.output_len}"


@dataclass(frozen=True)
class LoadProfile:
    phases: tuple[Phase, ...]

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError("a load profile needs at least one phase")

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    @property
    def starts(self) -> list[float]:
        out, t = [], 0.0
        for p in self.phases:
            out.append(t)
            t += p.duration_s
        return out

    def names(self) -> list[str]:
        return [p.name or f"phase{i + 1}" for i, p in enumerate(self.phases)]

    def phase_at(self, t: float) -> int | None:
        """The phase running `t` s after the start; None outside the profile."""
        for i, (start, p) in enumerate(zip(self.starts, self.phases, strict=True)):
            if start <= t < start + p.duration_s:
                return i
        return None

    def __str__(self) -> str:
        return ",".join(p.spec for p in self.phases)


_PHASE = re.compile(r"^(?:(?P<name>[A-Za-z_][\w-]*)=)?(?P<dur>[0-9]*\.?[0-9]+)(?P<unit>s|m)?@(?P<rate>[0-9]*\.?[0-9]+)"
                    r":(?P<inp>[0-9]+)/(?P<out>[0-9]+)$")


def parse_load_profile(text: str) -> LoadProfile:
    """A profile from its spec string or from a JSON file (a path that exists, or ends in .json)."""
    text = text.strip()
    path = Path(text).expanduser()
    if text.endswith(".json") or path.is_file():
        return _from_json(path)
    phases = []
    for part in filter(None, (t.strip() for t in text.split(","))):
        m = _PHASE.match(part)
        if m is None:
            raise ValueError(f"bad load-profile phase {part!r}: expected [NAME=]DURATION@RATE:INPUT/OUTPUT, "
                             "e.g. 90s@0.5:128/256 (DURATION in s or m)")
        dur = float(m["dur"]) * (60.0 if m["unit"] == "m" else 1.0)
        phases.append(Phase(dur, float(m["rate"]), int(m["inp"]), int(m["out"]), m["name"] or ""))
    return LoadProfile(tuple(phases))


def _from_json(path: Path) -> LoadProfile:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"load profile {path}: {e}") from None
    items = data.get("phases") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ValueError(f"load profile {path}: expected a list of phases or {{\"phases\": [...]}}")
    phases = []
    for i, d in enumerate(items):
        try:
            phases.append(Phase(float(d.get("duration_s", d.get("duration"))), float(d["rate"]), int(d["input_len"]),
                                int(d["output_len"]), str(d.get("name", ""))))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"load profile {path}: phase {i + 1} needs duration_s, rate, input_len and output_len "
                             f"({type(e).__name__}: {e})") from None
    return LoadProfile(tuple(phases))


# ---- the trace -----------------------------------------------------------------------------------

def arrival_schedule(profile: LoadProfile, burstiness: float, seed: int) -> list[tuple[float, int]]:
    """(send time in s from the start, phase index) of every request, in time order."""
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    rng = random.Random(seed)
    out = []
    for i, (start, p) in enumerate(zip(profile.starts, profile.phases, strict=True)):
        if p.rate == 0:
            continue
        t, end, scale = start, start + p.duration_s, 1.0 / (p.rate * burstiness)
        while True:
            t += rng.gammavariate(burstiness, scale)
            if t >= end:
                break
            out.append((t, i))
    return out


def build_requests(profile: LoadProfile, schedule: Sequence[tuple[float, int]], dataset, tokenizer,
                   build) -> list[BenchRequest]:
    """The requests of `schedule`, each phase's from `build(dataset config, tokenizer)` with the phase's
    lengths and count and its own seed (seed + phase index), tagged with their phase."""
    counts = [sum(1 for _, i in schedule if i == k) for k in range(len(profile.phases))]
    by_phase: list[list[BenchRequest]] = []
    for k, (p, n) in enumerate(zip(profile.phases, counts, strict=True)):
        if n == 0:
            by_phase.append([])
            continue
        cfg = dataclasses.replace(dataset, num_prompts=n, input_len=p.input_len, output_len=p.output_len,
                                  seed=dataset.seed + k)
        by_phase.append([dataclasses.replace(r, phase=k) for r in build(cfg, tokenizer)])
    taken = [0] * len(profile.phases)
    reqs = []
    for _, k in schedule:
        reqs.append(by_phase[k][taken[k]])
        taken[k] += 1
    return reqs


# ---- what it measured ----------------------------------------------------------------------------

@dataclass
class PhaseResult:
    index: int
    name: str
    phase: Phase
    start_s: float
    sent: int
    metrics: BenchMetrics

    def to_dict(self) -> dict:
        return {"phase": self.index, "name": self.name, "spec": self.phase.spec, "start_s": self.start_s,
                "duration_s": self.phase.duration_s, "rate": self.phase.rate, "input_len": self.phase.input_len,
                "output_len": self.phase.output_len, "sent": self.sent, "metrics": self.metrics.to_dict()}


def phase_metrics(profile: LoadProfile, records: Sequence[RequestRecord], slo: SLO,
                  percentiles: Sequence[float]) -> list[PhaseResult]:
    out = []
    for k, (name, start, p) in enumerate(zip(profile.names(), profile.starts, profile.phases, strict=True)):
        mine = [r for r in records if r.phase == k]
        out.append(PhaseResult(k, name, p, start, len(mine), compute_metrics(mine, p.duration_s, slo, percentiles)))
    return out


def time_series(profile: LoadProfile, records: Sequence[RequestRecord], t0: float, slo: SLO,
                window_s: float = 5.0) -> list[dict]:
    """Per window of `window_s` from the start until the last request ended: the offered rate (of the
    phase at the window's start), requests sent, completed, good (met the SLO) and failed by their
    end, and goodput (good / window)."""
    if not window_s > 0:
        raise ValueError(f"the time-series window must be > 0 s, got {window_s}")
    end = max([profile.duration_s, *(r.end - t0 for r in records)])
    n = max(1, math.ceil(end / window_s - 1e-9))
    rows = [{"t_s": round(i * window_s, 3), "offered_rate": 0.0, "phase": profile.phase_at(i * window_s),
             "sent": 0, "completed": 0, "good": 0, "failed": 0} for i in range(n)]
    for row in rows:
        if row["phase"] is not None:
            row["offered_rate"] = profile.phases[row["phase"]].rate

    def at(t: float) -> dict:
        return rows[min(n - 1, max(0, int((t - t0) // window_s)))]

    for r in records:
        at(r.start)["sent"] += 1
        done = at(r.end)
        if r.success:
            done["completed"] += 1
            done["good"] += slo.met(r)
        else:
            done["failed"] += 1
    for row in rows:
        row["goodput"] = row["good"] / window_s
    return rows


def format_phase_table(phases: Sequence[PhaseResult]) -> str:
    """One aligned line per phase, for the terminal."""
    head = (f"{'phase':<12s}{'spec':<24s}{'sent':>6s}{'ok':>6s}{'fail':>6s}{'good':>6s}{'goodput':>9s}"
            f"{'TTFT p50':>10s}{'p99':>9s}{'TPOT p50':>10s}{'p99':>9s}")
    lines = [head]
    for ph in phases:
        m = ph.metrics
        lines.append(f"{ph.name:<12s}{ph.phase.spec:<24s}{ph.sent:>6d}{m.completed:>6d}{m.failed:>6d}"
                     f"{m.good_requests:>6d}{m.goodput:>9.3f}{_p(m.ttft, 50):>10.0f}{_p(m.ttft, 99):>9.0f}"
                     f"{_p(m.tpot, 50):>10.1f}{_p(m.tpot, 99):>9.1f}")
    return "(ms)  goodput = requests of the phase that met the SLO / the phase's length\n" + "\n".join(lines)


def _p(stats, q: float) -> float:
    return stats.percentiles.get(f"p{q:g}", math.nan)
