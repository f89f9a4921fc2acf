"""`tandem up` applies a shape live: workers move between the prefill and decode roles on fixed slots.

A slot is one worker's place: its cores (plan_cores at start) never change; its role does. The
number of slots is what `tandem up` started, so a shape fits when prefill + decode == slots.

Moving one slot (one at a time, the least loaded worker of the role that shrinks):
1. draining: the Supervisor forgets the worker (`retire`: not restarted, not reported), and it gets
   SIGTERM. Its drain is P/D-safe: it leaves the registry (the router stops routing to it), finishes
   what it holds (a prefill worker every transfer it owes, a decode worker every running stream),
   then exits. Past `drain_s` it is killed (the router migrates a stream still running on it).
2. starting: once it exited, a worker of the new role starts on the same cores under a new name (so a
   new worker id: never confused with the one that left), supervised like the others.
3. serving again when it printed its READY line (it is registered): the next slot may move.

A shape with no prefill worker is refused unless the router serves without one (--min-prefill-workers
0). Why drain + restart rather than switching a worker's role in place: docs/planner.md, "On one host".

Single-threaded: the launcher's main loop calls `poll()` a few times a second; nothing here blocks
(the one load query is a /metrics scrape with a short timeout, once per moved slot).
"""

from __future__ import annotations

import json
import logging
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from tandem.services.common.cpu_cores import format_cpu_list
from tandem.services.launcher.procs import Child
from tandem.services.launcher.supervisor import Supervisor
from tandem.services.planner.host import ShapeStore
from tandem.services.planner.shape import Shape

log = logging.getLogger(__name__)

PUBLISH_S = 2.0   # the state is written at least this often (readers tell a live launcher by its "t")


class ShapeError(ValueError):
    """A shape this deployment cannot take; the message says why."""


@dataclass
class Slot:
    index: int
    cores: tuple[int, ...] | None
    role: str                      # prefill | decode (the new role from `starting` on)
    name: str                      # the Supervisor's name of its worker
    state: str = "serving"         # serving | draining | starting
    since: float = 0.0
    retired: Child | None = None   # the draining instance


def worker_load(child: Child) -> float:
    """Requests running and waiting on a worker, from its /metrics (inf: unknown, moved last)."""
    port = (child.ready or {}).get("metrics_port", -1)
    if port is None or port < 0:
        return float("inf")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1.0) as resp:
            text = resp.read().decode()
    except OSError:
        return float("inf")
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Reshaper:
    """`make_worker(role, name, cores)` builds (does not start) a worker's Child."""

    def __init__(self, sup: Supervisor, slots: list[Slot], make_worker: Callable[[str, str, tuple | None], Child],
                 *, drain_s: float, allow_no_prefill: bool, store: ShapeStore | None = None,
                 load: Callable[[Child], float] = worker_load, clock: Callable[[], float] = time.monotonic):
        self.sup = sup
        self.slots = slots
        self.make_worker = make_worker
        self.drain_s = drain_s
        self.allow_no_prefill = allow_no_prefill
        self.store = store
        self.load = load
        self.clock = clock
        self.used_names = {s.name for s in slots}
        self.target: Shape | None = None
        self.pending = 0               # seq of the request being applied
        self.applied = 0               # seq of the last request applied
        self.seen = 0                  # seq of the last request read
        self.error: dict | None = None
        self.last_move: dict | None = None   # the last slot moved: from, to, drain_s, start_s (to READY)
        self._published: tuple | None = None
        self._published_at = float("-inf")

    # ---- what runs -----------------------------------------------------------------------------
    def shape(self) -> Shape:
        """The roles of the slots (a slot on its way to a role counts as that role)."""
        return Shape(sum(s.role == "prefill" for s in self.slots), sum(s.role == "decode" for s in self.slots))

    @property
    def moving(self) -> Slot | None:
        return next((s for s in self.slots if s.state != "serving"), None)

    @property
    def busy(self) -> bool:
        return self.moving is not None or (self.target is not None and self.target != self.shape())

    def children(self) -> list[Child]:
        """Every worker instance alive or not: the slots' and a draining one (for the launcher's stop)."""
        out = [s.retired for s in self.slots if s.retired is not None]
        return out + [self.sup.entries[s.name].child for s in self.slots if s.name in self.sup.entries]

    def check(self, shape: Shape) -> None:
        n = len(self.slots)
        if shape.workers != n:
            raise ShapeError(f"{shape} needs {shape.workers} workers, but this deployment has {n} worker slots "
                             f"(`tandem up` started {n}; a shape moves workers between roles, it adds none): "
                             f"ask for a shape with prefill + decode = {n}")
        if shape.prefill == 0 and not self.allow_no_prefill:
            raise ShapeError(f"{shape} has no prefill worker, and the router needs one (--min-prefill-workers "
                             f"is not 0; `tandem up --planner` sets it to 0)")

    # ---- requests ------------------------------------------------------------------------------
    def request(self, shape: Shape | str, seq: int, reason: str = "") -> None:
        """Move to `shape` (the latest request wins, also over one being applied: the slot that is
        moving finishes its move first). A shape that does not fit is refused with `error`."""
        self.seen = max(self.seen, seq)
        try:
            shape = Shape.parse(shape) if isinstance(shape, str) else shape
            self.check(shape)
        except ValueError as e:
            self.error = {"seq": seq, "message": str(e)}
            log.error("reshape %s refused: %s", shape, e)
            return
        self.target, self.pending, self.error = shape, seq, None
        log.warning("reshape to %s requested (seq %d%s); now %s", shape, seq, f": {reason}" if reason else "",
                    self.shape())

    def poll(self) -> None:
        if self.store is not None:
            self._read_store()
        now = self.clock()
        slot = self.moving
        if slot is None:
            if self.target is not None and self.target != self.shape():
                self._begin(now)
            elif self.target is not None and self.applied < self.pending:
                self.applied = self.pending
                log.warning("reshape to %s applied (seq %d)", self.target, self.pending)
        elif slot.state == "draining":
            self._drain_step(slot, now)
        else:
            self._start_step(slot)
        if self.store is not None:
            self._publish(now)

    # ---- the steps -----------------------------------------------------------------------------
    def _begin(self, now: float) -> None:
        current = self.shape()
        shrink = "prefill" if self.target.prefill < current.prefill else "decode"
        grow = "decode" if shrink == "prefill" else "prefill"
        candidates = [s for s in self.slots if s.role == shrink and s.name in self.sup.entries]
        if not candidates:
            self.error = {"seq": self.pending, "message": f"no running {shrink} worker to move"}
            self.target = None
            return
        loads = {s.index: self.load(self.sup.entries[s.name].child) for s in candidates}
        slot = min(candidates, key=lambda s: (loads[s.index], s.index))
        slot.retired = self.sup.retire(slot.name)
        slot.retired.terminate()
        slot.role, slot.state, slot.since = grow, "draining", now
        log.warning("reshape %s -> %s: draining %s (load %s) to restart its cores as %s", current, self.target,
                    slot.name, loads[slot.index], grow)

    def _drain_step(self, slot: Slot, now: float) -> None:
        old = slot.retired
        if old.alive:
            if now - slot.since > self.drain_s:
                log.error("%s still draining after %.0fs: killing it", old.name, self.drain_s)
                old.kill()
            return
        code = old.proc.returncode if old.proc is not None else None
        log.warning("%s drained (exit code %s) in %.1fs", old.name, code, now - slot.since)
        self.last_move = {"slot": slot.index, "from": old.name, "to": None, "drain_s": round(now - slot.since, 2),
                          "start_s": None}
        slot.retired = None
        slot.name = self._new_name(slot.role)
        child = self.make_worker(slot.role, slot.name, slot.cores)
        child.start()
        self.sup.add(slot.name, child, _respawn(child))
        slot.state, slot.since = "starting", now

    def _start_step(self, slot: Slot) -> None:
        if slot.name in self.sup.gave_up:
            self.error = {"seq": self.pending, "message": f"{slot.name} (new {slot.role} worker) did not start: "
                                                          f"the supervisor gave up on it"}
            self.target = None
            slot.state = "serving"   # a slot with no live worker: the next request may move it again
            return
        if self.sup.entries[slot.name].child.ready is not None:
            start_s = self.clock() - slot.since
            log.warning("%s is ready (%.1fs after its predecessor exited)", slot.name, start_s)
            self.last_move = {**(self.last_move or {}), "to": slot.name, "start_s": round(start_s, 2)}
            slot.state = "serving"

    def _new_name(self, role: str) -> str:
        i = 0
        while f"{role}-{i}" in self.used_names:
            i += 1
        self.used_names.add(f"{role}-{i}")
        return f"{role}-{i}"

    # ---- Redis ---------------------------------------------------------------------------------
    def _read_store(self) -> None:
        try:
            desired = self.store.desired()
        except Exception as e:   # Redis restarting (the supervisor brings it back): try next poll
            log.debug("reading the desired shape: %s", e)
            return
        if not desired:
            if self.seen:   # Redis came back empty: say at once what was seen, so new seqs start above it
                self._published_at = float("-inf")
            return
        try:
            seq = int(desired["seq"])
        except (KeyError, TypeError, ValueError):
            return
        if seq > self.seen:
            self.request(str(desired.get("shape", "")), seq, str(desired.get("reason", "")))

    def snapshot(self) -> dict:
        return {"shape": str(self.shape()), "target": str(self.target) if self.target else None,
                "busy": self.busy, "seq": self.applied, "seen": self.seen, "error": self.error,
                "last_move": self.last_move,
                "slots": [{"slot": s.index, "role": s.role, "name": s.name, "state": s.state,
                           "cores": format_cpu_list(s.cores) if s.cores else None,
                           "pid": self._pid(s)} for s in self.slots]}

    def _pid(self, slot: Slot) -> int | None:
        e = self.sup.entries.get(slot.name)
        return e.child.proc.pid if e is not None and e.child.proc is not None else None

    def _publish(self, now: float) -> None:
        state = self.snapshot()
        key = json.dumps(state, sort_keys=True)
        if key == self._published and now - self._published_at < PUBLISH_S:
            return
        try:
            self.store.publish({**state, "t": time.time()})
        except Exception as e:
            log.debug("publishing the shape state: %s", e)
            return
        self._published, self._published_at = key, now


def _respawn(child: Child) -> Callable[[], Child]:
    """The Supervisor's restart of a worker: same command line, same name and id."""
    def start() -> Child:
        fresh = Child(child.name, child.argv, env=child.env, on_line=child.on_line)
        fresh.start()
        return fresh
    return start
