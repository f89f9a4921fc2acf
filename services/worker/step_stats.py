"""What each forward pass did, as Prometheus metrics, a periodic log line while the worker is busy and,
with `--step-trace-dir`, one JSON line per step (what `bench/sched_sim.py` fits its step costs to).

Runs on the engine thread right after each step (`EngineLoop` observers): the step's wall time comes
from the loop's perf_counter around it (no device sync is added), its shape from the `StepBatch` the
model runner last ran. Torch-free.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tandem.services.worker import metrics

log = logging.getLogger(__name__)

STEP_KINDS = ("prefill", "decode", "mixed")


@dataclass(frozen=True)
class StepShape:
    kind: str             # prefill | decode | mixed (a step with both prefill chunks and decode rows)
    num_seqs: int         # batch size: sequences in the step
    prefill_tokens: int   # prompt (or recomputed) tokens run by prefill chunks
    decode_tokens: int    # decode rows: one new token each (plus its drafts when speculating)

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


def shape_of(batch) -> StepShape:
    """A `StepBatch`'s shape: the scheduler marks decode rows (`SeqStep.decode`; a speculative one also
    runs its drafts); anything else is a prefill chunk."""
    prefill = decode = 0
    for s in batch.seqs:
        if s.decode:
            decode += len(s.input_ids)
        else:
            prefill += len(s.input_ids)
    kind = "mixed" if prefill and decode else ("decode" if decode else "prefill")
    return StepShape(kind, len(batch.seqs), prefill, decode)


class StepTrace:
    """Appends one JSON line per forward pass to `<dir>/<worker id>.jsonl`: `end` (wall-clock seconds,
    so the traces of several workers line up), `kind`, `decode_tokens` (one per decode row, plus its
    drafts when speculating), `prefill_tokens`, `seconds`. Line-buffered, so a trace read while the
    worker runs is whole up to its last step. A write that fails (a full disk) is logged once and
    ends the trace; serving goes on."""

    def __init__(self, directory: str | Path, name: str):
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"{name.replace('/', '_')}.jsonl"
        self._f = self.path.open("a", buffering=1)

    def write(self, shape: StepShape, elapsed_s: float) -> None:
        if self._f is None:
            return
        line = {"end": round(time.time(), 6), "kind": shape.kind, "decode_tokens": shape.decode_tokens,
                "prefill_tokens": shape.prefill_tokens, "seconds": round(elapsed_s, 6)}
        try:
            self._f.write(json.dumps(line) + "\n")
        except OSError as e:
            log.error("step trace %s: %s; no more steps are traced", self.path, e)
            self.close()

    def close(self) -> None:
        if self._f is not None:
            f, self._f = self._f, None
            try:
                f.close()
            except OSError:
                pass


@dataclass
class _Window:
    """Steps since the last log line."""

    start: float = 0.0
    steps: int = 0
    busy_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    kinds: dict[str, int] | None = None


class StepStats:
    """Engine-thread step observer. `runner` is the model runner (its `last_batch` is the batch its
    latest forward pass ran); `load()` returns the worker's `WorkerLoad` (running, waiting, pages).
    Every `log_interval_s` of busy time one INFO line is logged; a worker with no steps logs nothing
    (0 turns the line off; the metrics stay). `trace`: also write every step to it."""

    def __init__(self, runner, load: Callable[[], object], name: str, log_interval_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, trace: StepTrace | None = None):
        self.runner = runner
        self.trace = trace
        self.load = load
        self.name = name
        self.log_interval_s = log_interval_s
        self.clock = clock
        self._seen = None        # the last batch accounted for (a step may run no forward pass)
        self._graph_steps = 0    # the runner's graph replays accounted for
        self._w = _Window()

    def before_step(self) -> None:
        pass

    def after_step(self, elapsed_s: float) -> None:
        batch = getattr(self.runner, "last_batch", None)
        if batch is None or batch is self._seen:
            return
        self._seen = batch
        shape = shape_of(batch)
        metrics.STEP_TIME.labels(shape.kind).observe(elapsed_s)
        metrics.STEP_BATCH_SIZE.labels(shape.kind).observe(shape.num_seqs)
        metrics.STEP_TOKENS.labels(shape.kind).observe(shape.num_tokens)
        if self.trace is not None:
            self.trace.write(shape, elapsed_s)
        if shape.prefill_tokens:
            metrics.STEP_TOKENS_TOTAL.labels("prefill").inc(shape.prefill_tokens)
        if shape.decode_tokens:
            metrics.STEP_TOKENS_TOTAL.labels("decode").inc(shape.decode_tokens)
        graphs = getattr(self.runner, "graphs", None)
        if graphs is not None and graphs.replays > self._graph_steps:
            metrics.GRAPH_STEPS.inc(graphs.replays - self._graph_steps)
            self._graph_steps = graphs.replays
        if self.log_interval_s <= 0:
            return
        now = self.clock()
        w = self._w
        if w.steps == 0:  # the first step after a quiet spell opens the window at its own start
            w.start, w.kinds = now - elapsed_s, dict.fromkeys(STEP_KINDS, 0)
        w.steps += 1
        w.busy_s += elapsed_s
        w.prefill_tokens += shape.prefill_tokens
        w.decode_tokens += shape.decode_tokens
        w.kinds[shape.kind] += 1
        if now - w.start >= self.log_interval_s:
            self._log_window(now)

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()

    def _log_window(self, now: float) -> None:
        w, self._w = self._w, _Window()
        span = max(now - w.start, 1e-9)
        load = self.load()
        usage = 1.0 - load.free_pages / load.total_pages if load.total_pages else 0.0
        log.info("%s: #running-req %d, #queue-req %d, prefill %.1f tok/s, gen throughput %.1f tok/s, "
                 "KV usage %.1f%%, %d steps (%s) at %.1f ms/step, busy %.0f%%",
                 self.name, load.running, load.waiting, w.prefill_tokens / span, w.decode_tokens / span,
                 100.0 * usage, w.steps, " ".join(f"{k} {n}" for k, n in w.kinds.items() if n),
                 1000.0 * w.busy_s / w.steps, 100.0 * min(1.0, w.busy_s / span))
