"""CPU placement: the cores each process runs on (`--cpu-cores`), and how `tandem up` splits them.

A worker pinned to its own cores, with as many torch threads as it has cores, cannot have its
forward passes slowed by another worker's burst (a prefill stealing the decode worker's core), and
torch threads never oversubscribe a core (OpenMP threads that share a core spin and crawl).

Everything here but `pin` and `available_cores` is a pure function on ints.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

# "none" turns pinning off; "nobind" is what vLLM's VLLM_CPU_OMP_THREADS_BIND (and SGLang's
# SGLANG_CPU_OMP_THREADS_BIND) call it, accepted so that their users need not look it up.
NO_PINNING = ("none", "nobind")
AUTO = "auto"
# `tandem up --cpu-cores 0-3|4-7`: one list per worker, as in VLLM_CPU_OMP_THREADS_BIND.
WORKER_SEPARATOR = "|"
_MAX_CORE = 1 << 16


class CpuListError(ValueError):
    """A core list that does not parse, or names cores this process may not use."""


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0', '0-3', '0,2,4-5' (Linux cpulist syntax) -> sorted distinct core numbers."""
    text = text.strip()
    if not text:
        raise CpuListError("empty core list (expected e.g. 0, 0-3 or 0,2)")
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            start = _core(lo)
            end = _core(hi) if sep else start
        except CpuListError:
            raise CpuListError(f"bad core list {text!r}: {part!r} is not a core number or a range "
                               "like 2-5 (expected e.g. 0, 0-3 or 0,2)") from None
        if end < start:
            raise CpuListError(f"bad core list {text!r}: range {part!r} ends before it starts")
        cores.update(range(start, end + 1))
    return tuple(sorted(cores))


def _core(s: str) -> int:
    s = s.strip()
    if not s.isdigit() or int(s) >= _MAX_CORE:
        raise CpuListError(s)
    return int(s)


def parse_worker_cores(text: str) -> tuple[int, ...] | None:
    """A worker's `--cpu-cores`: a core list, or None for `none` / `nobind` (no pinning)."""
    if text.strip().lower() in NO_PINNING:
        return None
    return parse_cpu_list(text)


def format_cpu_list(cores: Sequence[int]) -> str:
    """(0, 1, 2, 5) -> '0-2,5' (what `parse_cpu_list` reads back)."""
    runs: list[str] = []
    ordered = sorted(set(cores))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)


def check_available(cores: Sequence[int], available: Sequence[int]) -> None:
    missing = sorted(set(cores) - set(available))
    if missing:
        raise CpuListError(f"core(s) {format_cpu_list(missing)} not available to this process "
                           f"(available: {format_cpu_list(available)})")


@dataclass(frozen=True)
class CorePlan:
    """Where `tandem up` puts each process. `workers[i]` is the i-th worker in start order (prefill
    workers first, then decode); None means not pinned. `services` is for the launcher, Redis, the
    router and the gateway (None: not pinned)."""

    workers: tuple[tuple[int, ...] | None, ...]
    services: tuple[int, ...] | None = None
    shared: bool = False            # more workers than cores: some workers share a core

    @property
    def pinned(self) -> bool:
        return any(w is not None for w in self.workers)

    def services_nice(self, requested: int) -> int:
        """The services' niceness: `requested` (--services-nice) while they share the workers' cores, else 0."""
        return requested if self.services is None else 0


def assign_cores(cores: Sequence[int], num_workers: int) -> CorePlan:
    """The default policy: each worker gets its own contiguous share of `cores` (shares differ by at
    most one core; earlier workers get the larger ones). Gateway, router and Redis get one core of
    their own when there are more cores than workers and at least 3 cores; otherwise they are not
    pinned (on 2 cores, taking one from a co-located worker would halve its compute for services
    that use a fraction of a core). With fewer cores than workers, workers share cores round-robin."""
    assert num_workers >= 1
    cores = sorted(set(cores))
    assert cores, "no cores to assign"
    n = len(cores)
    if n < num_workers:
        return CorePlan(tuple((cores[i % n],) for i in range(num_workers)), None, shared=True)
    services: tuple[int, ...] | None = None
    if n > num_workers and n >= 3:
        services, cores = (cores[-1],), cores[:-1]
        n -= 1
    per, extra = divmod(n, num_workers)
    shares, at = [], 0
    for i in range(num_workers):
        size = per + (1 if i < extra else 0)
        shares.append(tuple(cores[at:at + size]))
        at += size
    return CorePlan(tuple(shares), services)


def plan_cores(spec: str, available: Sequence[int], num_workers: int) -> CorePlan:
    """`tandem up --cpu-cores SPEC`: `auto` (split the cores this process may use), `none`/`nobind`
    (no pinning), a core list (split those cores), or one list per worker separated by `|` (used
    as given; gateway/router/Redis get the listed cores no worker has, if any, else no pinning)."""
    spec = spec.strip()
    if spec.lower() in NO_PINNING:
        return CorePlan((None,) * num_workers)
    if spec.lower() == AUTO:
        return assign_cores(available, num_workers)
    if WORKER_SEPARATOR in spec:
        lists = [parse_cpu_list(p) for p in spec.split(WORKER_SEPARATOR)]
        if len(lists) != num_workers:
            raise CpuListError(f"{spec!r} gives {len(lists)} core lists for {num_workers} "
                               f"worker(s) (one per worker, prefill workers first, separated by '|')")
        for cores in lists:
            check_available(cores, available)
        used = {c for cores in lists for c in cores}
        rest = tuple(c for c in sorted(set(available)) if c not in used)
        return CorePlan(tuple(lists), rest or None)
    pool = parse_cpu_list(spec)
    check_available(pool, available)
    return assign_cores(pool, num_workers)


def describe(plan: CorePlan, names: Sequence[str], services_nice: int = 0) -> str:
    """One line for people: 'prefill-0 core 0, decode-0 core 1; gateway/router/Redis unpinned, nice 10'."""
    nice = f", nice {services_nice}" if services_nice else ""
    if not plan.pinned:
        return "not pinned (--cpu-cores none)" + (f"; gateway/router/Redis{nice}" if nice else "")
    parts = [f"{name} {_cores_phrase(cores)}" for name, cores in zip(names, plan.workers, strict=True)]
    services = ("unpinned" if plan.services is None else _cores_phrase(plan.services)) + nice
    note = " (more workers than cores: shared)" if plan.shared else ""
    return ", ".join(parts) + f"; gateway/router/Redis {services}{note}"


def _cores_phrase(cores: Sequence[int] | None) -> str:
    if cores is None:
        return "unpinned"
    return f"{'core' if len(cores) == 1 else 'cores'} {format_cpu_list(cores)}"


def available_cores() -> tuple[int, ...]:
    """The cores this process may run on (its affinity mask, which respects cgroup cpusets)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return tuple(range(os.cpu_count() or 1))


def pin(cores: Sequence[int]) -> None:
    """Restrict this process's calling thread, and every thread it starts afterwards, to `cores`:
    call it before torch, gRPC or asyncio start their thread pools. Raises CpuListError.

    Checked against what the kernel allows (cgroup cpuset), not against this process's current
    mask: `tandem up` starts workers from a launcher that may be pinned to the services' core."""
    try:
        os.sched_setaffinity(0, cores)
    except AttributeError as e:
        raise CpuListError("--cpu-cores needs Linux (os.sched_setaffinity)") from e
    except OSError as e:  # EINVAL: none of the cores exists or is allowed here
        raise CpuListError(f"cannot pin to core(s) {format_cpu_list(cores)}: {e.strerror} (none of them is "
                           f"available here; this process runs on {format_cpu_list(available_cores())})") from e
    got = os.sched_getaffinity(0)
    if got != set(cores):  # the kernel silently drops cores that are not allowed
        missing = sorted(set(cores) - got)
        raise CpuListError(f"core(s) {format_cpu_list(missing)} not available to this process "
                           f"(it may use: {format_cpu_list(sorted(got))} of {format_cpu_list(cores)})")
    _pin_other_threads(cores)


def _pin_other_threads(cores: Sequence[int]) -> None:
    # Threads that imports already started (thread pools of native libraries) keep the mask they
    # were born with: move them too.
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # exited meanwhile
            pass
