"""Step metrics and the busy log line, driven by hand with fake batches and a fake clock."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from prometheus_client import REGISTRY

from tandem.engine.scheduler.batch import SeqStep, StepBatch
from tandem.services.worker.step_stats import StepStats, shape_of


@dataclass
class Req:
    fill_len: int
    prompt_ids: list = field(default_factory=list)


def prefill_chunk(n: int, start: int = 0, fill: int = 100) -> SeqStep:
    return SeqStep(Req(fill), [1] * n, start, sample=start + n == fill)


def decode_row(pos: int = 100, fill: int = 100) -> SeqStep:
    return SeqStep(Req(fill), [1], pos, sample=True, decode=True)


@dataclass
class Load:
    running: int = 3
    waiting: int = 2
    free_pages: int = 75
    total_pages: int = 100


class Runner:
    last_batch = None


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_step_kinds():
    assert shape_of(StepBatch([decode_row(), decode_row(120)])).kind == "decode"
    assert shape_of(StepBatch([prefill_chunk(16), prefill_chunk(16, 16)])).kind == "prefill"
    mixed = shape_of(StepBatch([decode_row(), prefill_chunk(7, 0, 7)]))
    assert (mixed.kind, mixed.num_seqs, mixed.prefill_tokens, mixed.decode_tokens) == ("mixed", 2, 7, 1)
    # A one-token last chunk of a prompt is prefill, not decode.
    assert shape_of(StepBatch([prefill_chunk(1, 16, 17)])).kind == "prefill"
    # A speculative row (last token + 3 drafts) is a decode row running 4 tokens.
    spec = shape_of(StepBatch([SeqStep(Req(100), [1, 2, 3, 4], 100, sample=True, decode=True, num_drafts=3), decode_row()]))
    assert (spec.kind, spec.decode_tokens, spec.prefill_tokens) == ("decode", 5, 0)


def _sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_each_step_feeds_the_histograms():
    runner = Runner()
    stats = StepStats(runner, Load, "w", log_interval_s=0)
    before = (_sample("tandem_step_duration_seconds_count", kind="mixed"),
              _sample("tandem_step_batch_size_sum", kind="mixed"), _sample("tandem_step_tokens_sum", kind="mixed"),
              _sample("tandem_engine_tokens_total", phase="prefill"), _sample("tandem_engine_tokens_total", phase="decode"))
    runner.last_batch = StepBatch([decode_row(), decode_row(), prefill_chunk(5, 0, 5)])
    stats.after_step(0.02)
    stats.after_step(0.02)  # the same batch again: the step ran no forward pass, nothing counted
    after = (_sample("tandem_step_duration_seconds_count", kind="mixed"),
             _sample("tandem_step_batch_size_sum", kind="mixed"), _sample("tandem_step_tokens_sum", kind="mixed"),
             _sample("tandem_engine_tokens_total", phase="prefill"), _sample("tandem_engine_tokens_total", phase="decode"))
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 3, 7, 5, 2]


def test_busy_line_every_interval_and_silence_when_idle(caplog):
    caplog.set_level(logging.INFO, logger="tandem.services.worker.step_stats")
    runner, clock = Runner(), Clock()
    stats = StepStats(runner, Load, "decode-0", log_interval_s=5.0, clock=clock)

    def step(batch, dt=0.125):
        clock.t += dt
        runner.last_batch = batch
        stats.after_step(dt)

    for _ in range(39):  # 4.875 s of decode steps, 4 rows each: no line yet
        step(StepBatch([decode_row() for _ in range(4)]))
    assert not caplog.records
    step(StepBatch([decode_row() for _ in range(3)] + [prefill_chunk(100)]))
    [rec] = caplog.records
    line = rec.getMessage()
    assert line.startswith("decode-0: #running-req 3, #queue-req 2, prefill 20.0 tok/s, gen throughput 31.8 tok/s, "
                           "KV usage 25.0%, 40 steps (decode 39 mixed 1) at 125.0 ms/step"), line
    caplog.clear()
    clock.t += 600.0  # idle for ten minutes: nothing is logged, whatever the clock says
    assert not caplog.records
    # The first step after the quiet spell opens a new window: rates are over busy time, not the gap.
    for _ in range(40):
        step(StepBatch([decode_row()]))
    [rec] = caplog.records
    assert "gen throughput 8.0 tok/s" in rec.getMessage()


def test_interval_zero_logs_nothing(caplog):
    caplog.set_level(logging.INFO, logger="tandem.services.worker.step_stats")
    runner, clock = Runner(), Clock()
    stats = StepStats(runner, Load, "w", log_interval_s=0, clock=clock)
    for _ in range(100):
        clock.t += 1
        runner.last_batch = StepBatch([decode_row()])
        stats.after_step(1.0)
    assert not caplog.records


def test_graph_steps_counter_follows_the_runners_replays():
    class Graphs:
        replays = 0

    runner = Runner()
    runner.graphs = Graphs()
    stats = StepStats(runner, Load, "w", log_interval_s=0)
    before = _sample("tandem_graph_steps_total")
    for replays in (1, 2, 2):   # two decode steps from a graph, then one that ran eagerly
        runner.graphs.replays = replays
        runner.last_batch = StepBatch([decode_row()])
        stats.after_step(0.01)
    assert _sample("tandem_graph_steps_total") - before == 2


def test_trace_appends_a_json_line_per_step(tmp_path):
    import json

    from tandem.services.worker.step_stats import StepTrace

    runner = Runner()
    stats = StepStats(runner, Load, "w", log_interval_s=0, trace=StepTrace(tmp_path / "steps", "colocated-0"))
    runner.last_batch = StepBatch([decode_row(), decode_row(), prefill_chunk(5, 0, 5)])
    stats.after_step(0.02)
    stats.after_step(0.02)            # the same batch again (a step without a forward pass): no line
    runner.last_batch = StepBatch([decode_row()])
    stats.after_step(0.01)
    stats.close()
    lines = [json.loads(x) for x in (tmp_path / "steps" / "colocated-0.jsonl").read_text().splitlines()]
    assert [(x["kind"], x["decode_tokens"], x["prefill_tokens"], x["seconds"]) for x in lines] == \
        [("mixed", 2, 5, 0.02), ("decode", 1, 0, 0.01)]
    assert lines[0]["end"] <= lines[1]["end"]
    # A restarted worker appends to its file.
    again = StepStats(runner, Load, "w", log_interval_s=0, trace=StepTrace(tmp_path / "steps", "colocated-0"))
    runner.last_batch = StepBatch([decode_row()])
    again.after_step(0.01)
    again.close()
    assert len((tmp_path / "steps" / "colocated-0.jsonl").read_text().splitlines()) == 3


def test_a_failing_trace_write_is_logged_once_and_ends_the_trace(tmp_path, caplog):
    from tandem.services.worker.step_stats import StepTrace

    class Full:
        def write(self, _):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    trace = StepTrace(tmp_path, "w")
    trace._f.close()
    trace._f = Full()
    runner = Runner()
    stats = StepStats(runner, Load, "w", log_interval_s=0, trace=trace)
    with caplog.at_level(logging.ERROR, logger="tandem.services.worker.step_stats"):
        for _ in range(3):
            runner.last_batch = StepBatch([decode_row()])
            stats.after_step(0.01)
    assert [r.getMessage() for r in caplog.records if "step trace" in r.getMessage()] == \
        [f"step trace {trace.path}: [Errno 28] No space left on device; no more steps are traced"]
    stats.close()   # closing again is harmless
