"""Who waits in front of whom, who is turned away when a queue is full, who may preempt whom.

Torch-free and model-free: it works on anything with `priority` and `arrival` (engine requests, a
decode worker's prealloc rooms, the router's waiters), so one policy orders every queue.

- FIFO (priority scheduling off): arrival order; `priority` is ignored everywhere, so a full queue
  always turns away the newcomer, and nothing preempts.
- Priority scheduling: more urgent first, then earlier arrival. "More urgent" is a higher
  `priority`, or a lower one with `low_values_first` (SGLang's `--schedule-low-priority-values-first`).
  A full queue turns away whoever would be served last (the newcomer when it ties or is the least
  urgent), and a waiting request may preempt a running one whose urgency is lower by more than
  `preemption_threshold`.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


class Prioritized(Protocol):
    priority: int
    arrival: float


T = TypeVar("T", bound=Prioritized)


def check_priority(value: object) -> int:
    """The one range check of a request's priority: an int32 (bools are not integers here)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"priority must be an integer, got {type(value).__name__} {value!r}")
    if not INT32_MIN <= value <= INT32_MAX:
        raise ValueError(f"priority must be in [{INT32_MIN}, {INT32_MAX}], got {value}")
    return value


@dataclass(frozen=True)
class QueuePolicy:
    enable_priority: bool = False
    low_values_first: bool = False
    preemption_threshold: int = 10

    def urgency(self, item: Prioritized) -> int:
        """Bigger is served first; 0 for everyone when priority scheduling is off."""
        if not self.enable_priority:
            return 0
        return -item.priority if self.low_values_first else item.priority

    def may_preempt(self, waiting: Prioritized, running: Prioritized) -> bool:
        return self.enable_priority and self.urgency(waiting) - self.urgency(running) > self.preemption_threshold

    def preemption_victim(self, waiting: Prioritized, running: Iterable[T], progress: Callable[[T], int]) -> T | None:
        """The running request `waiting` may displace: the least urgent, then the least progress
        (it loses the least work), then the newest. None when no one is far enough below."""
        victims = [r for r in running if self.may_preempt(waiting, r)]
        if not victims:
            return None
        return min(victims, key=lambda r: (self.urgency(r), progress(r), -r.arrival))


    def queue_full_message(self, queue: str, capacity: int, newcomer: Prioritized) -> str:
        why = (f" and no queued request has a lower priority than this one ({newcomer.priority})"
               if self.enable_priority else "")
        return f"{queue} is full ({capacity} requests, --max-queued-requests){why}; retry later"

    def evicted_message(self, queue: str, capacity: int, evicted: Prioritized, newcomer: Prioritized) -> str:
        return (f"turned away from a full {queue} ({capacity} requests, --max-queued-requests): a request "
                f"of higher priority ({newcomer.priority}) arrived and this one ({evicted.priority}) was "
                f"the lowest; retry later")


class PolicyQueue(Generic[T]):
    """A waiting queue kept in the policy's order. Deque-like where the scheduler needs it:
    `append` queues by policy; `appendleft` puts a retracted request back in front (FIFO) or at its
    place by priority and original arrival (priority scheduling). Iteration is in service order.

    `order`: how equally urgent items are ordered, smallest first, in both modes (the router's
    admission passes the deadline: earliest deadline first); None: arrival (priority scheduling) or
    queueing order (FIFO). A full FIFO queue still turns away the newcomer whatever the order."""

    def __init__(self, policy: QueuePolicy, items: Iterable[T] = (), order: Callable[[T], float] | None = None):
        self.policy = policy
        self.order = order
        self._keys: list[tuple] = []
        self._items: list[T] = []
        self._seq = itertools.count(1)
        for item in items:
            self.append(item)

    def _rank(self, item: T) -> tuple:
        """Service order of `item` among others (smaller first), without the tie-breaking sequence."""
        tie = self.order(item) if self.order is not None else item.arrival
        return (-self.policy.urgency(item), tie, item.arrival)

    def _key(self, item: T, front: bool) -> tuple:
        n = next(self._seq)
        if self.policy.enable_priority or self.order is not None:
            return (*self._rank(item), n)
        return (0, -n if front else n)

    def _insert(self, item: T, front: bool) -> None:
        key = self._key(item, front)
        i = bisect.bisect(self._keys, key)
        self._keys.insert(i, key)
        self._items.insert(i, item)

    def append(self, item: T) -> None:
        self._insert(item, front=False)

    def appendleft(self, item: T) -> None:
        self._insert(item, front=True)

    def popleft(self) -> T:
        if not self._items:
            raise IndexError("pop from an empty queue")
        self._keys.pop(0)
        return self._items.pop(0)

    def remove(self, item: T) -> None:
        i = self._items.index(item)  # identity-equal requests (eq=False): the object itself
        del self._keys[i], self._items[i]

    def __getitem__(self, i: int) -> T:
        return self._items[i]

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._items))

    def __contains__(self, item: object) -> bool:
        return any(x is item for x in self._items)

    def offer(self, item: T, capacity: int, evictable: Callable[[T], bool] = lambda _: True) -> T | None:
        """Queue `item` within `capacity`. When full, the one served last among the evictable
        queued items and `item` itself is turned away and returned (removed if it was queued);
        None when everything fits. `item` is always evictable."""
        if len(self._items) < capacity:
            self.append(item)
            return None
        if not self.policy.enable_priority:
            return item  # FIFO: the newcomer is served last by definition
        candidates = [x for x in self._items if evictable(x)]
        last = max(candidates, key=self._rank, default=None)
        if last is None or self._rank(item) >= self._rank(last):
            return item
        self.remove(last)
        self.append(item)
        return last
