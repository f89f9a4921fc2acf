"""What a prefill worker tells decode workers about the rooms it is still computing (torch-free).

A decode worker gives up on a room that shows no progress for `--transfer-timeout`; on a slow CPU a
long prompt takes longer than that to prefill, so before each engine step P reports every
bootstrapped room in its scheduler (queued or being prefilled): tokens done, tokens of the prompt,
tokens it will compute first, and how soon its next report is due. Reports are throttled to one per
room per `interval_s` unless the step about to run is itself that long; a room just admitted is
reported before the next step either way. A P whose engine hangs stops reporting, so D still fails
its rooms about `--transfer-timeout` after the last report.

How long a step takes comes from the steps this worker ran (`PrefillPace`): a prefill worker runs
prompt tokens only, so seconds per prompt token is the one number that matters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from tandem.kvtransfer.base import KVSender, Progress
from tandem.services.prefill.rooms import PrefillRoom

# Before the first step is measured, assume a slow CPU: an AVX2-only CPU in bf16 measured ~42 ms per
# prompt token. Too high only delays noticing a hung first step; too low would fail healthy rooms.
DEFAULT_S_PER_TOKEN = 0.05
REPORT_INTERVAL_S = 1.0


class PrefillPace:
    """Seconds per prompt token, an exponentially weighted mean over the steps this worker ran."""

    def __init__(self, default_s_per_token: float = DEFAULT_S_PER_TOKEN, weight: float = 0.3):
        self.s_per_token = default_s_per_token
        self.weight = weight        # of the newest step: the estimate follows a change within a few steps
        self.steps = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        sample = seconds / tokens
        self.s_per_token = sample if self.steps == 0 else (1 - self.weight) * self.s_per_token + self.weight * sample
        self.steps += 1

    def step_s(self, tokens: int) -> float:
        return self.s_per_token * tokens


class ProgressReporter:
    """Sends the reports of one prefill worker; runs on its engine thread."""

    def __init__(self, sender: KVSender, pace: PrefillPace | None = None, interval_s: float = REPORT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.sender = sender
        self.pace = pace or PrefillPace()
        self.interval_s = interval_s
        self.clock = clock
        self.sent = 0                  # reports handed to the sender, for tests and metrics
        self._swept = float("-inf")    # when every room was last reported
        self._new: set[int] = set()    # rooms admitted since the last report

    def admitted(self, room: PrefillRoom) -> None:
        """The room joined the scheduler: report it before the next step, whatever the throttle."""
        self._new.add(room.room)

    def forget(self, room: PrefillRoom) -> None:
        self._new.discard(room.room)

    def before_step(self, sched, rooms: Mapping[str, PrefillRoom]) -> None:
        """Report the rooms due, in the order the scheduler offers them its prefill budget. `rooms`:
        request id -> room (a room computing before D's Bootstrap has no one to report to yet)."""
        now = self.clock()
        pending = sched.stats().prefill_tokens
        step_s = self.pace.step_s(min(sched.cfg.chunked_prefill_size, pending))
        sweep = now - self._swept >= self.interval_s or step_s >= self.interval_s
        if not (sweep or self._new):
            return
        # Every room is reported again before the first step that starts `interval_s` after this
        # sweep (or before the next step, when steps are that long): that is when D should hear next.
        expected_s = step_s if step_s >= self.interval_s else self.interval_s + step_s
        ahead = 0
        for req, tokens_left in sched.prefill_queue(now):
            room = rooms.get(req.rid)
            if (room is not None and room.info is not None and not room.state.done
                    and (sweep or room.room in self._new)):
                self.sender.progress(room.info.peer_id, room.room, Progress(
                    tokens_done=req.num_computed, tokens_total=len(req.prompt_ids), queued_ahead=ahead,
                    expected_s=expected_s))
                self.sent += 1
            ahead += tokens_left
        if sweep:
            self._swept = now
        self._new.clear()
