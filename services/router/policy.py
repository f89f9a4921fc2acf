"""Pairing policies: which worker of a role gets the next request. Plug new ones in with `register_policy`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence

from tandem.v1 import worker_pb2


class Policy(ABC):
    """Picks one worker among `candidates` (non-empty, in the registry's stable order).

    `inflight` counts the requests this router has in flight per worker_id: it reacts at once,
    while WorkerInfo.load is as old as the worker's last heartbeat. One instance serves one role.
    """

    @abstractmethod
    def pick(self, candidates: Sequence[worker_pb2.WorkerInfo], inflight: Mapping[str, int]) -> worker_pb2.WorkerInfo:
        ...


_POLICIES: dict[str, Callable[[], Policy]] = {}


def register_policy(name: str) -> Callable[[type[Policy]], type[Policy]]:
    def deco(cls: type[Policy]) -> type[Policy]:
        assert name not in _POLICIES, f"policy {name!r} registered twice"
        _POLICIES[name] = cls
        return cls

    return deco


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def make_policy(name: str) -> Policy:
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(policy_names())}") from None


@register_policy("round_robin")
class RoundRobin(Policy):
    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates, inflight):
        assert candidates
        worker = candidates[self._next % len(candidates)]
        self._next += 1
        return worker


@register_policy("least_load")
class LeastLoad(Policy):
    """Fewest queued + running requests (reported load plus this router's own in-flight count, which
    covers the requests sent since the last heartbeat), then most free KV pages, then list order."""

    def pick(self, candidates, inflight):
        assert candidates

        def score(w: worker_pb2.WorkerInfo) -> tuple[int, float]:
            load = w.load
            free = load.free_pages / load.total_pages if load.total_pages else 0.0
            return (load.running + load.waiting + inflight.get(w.worker_id, 0), -free)

        return min(candidates, key=score)
