"""Priority scheduling on a real (tiny) model: order, preemption with recompute, full-queue eviction."""

from __future__ import annotations

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.errors import ResourceExhausted
from tandem.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LOW, HIGH = [5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24]


def make(tiny_llama, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32", page_size=4, max_total_tokens=1024,
                                  context_length=128, enable_priority_scheduling=True, **kw))


@pytest.fixture(scope="module")
def alone(tiny_llama) -> dict[str, list[int]]:
    """Each prompt's greedy tokens when it runs by itself."""
    engine = make(tiny_llama)
    out = engine.generate([LOW, HIGH], GREEDY)
    return {"low": out[0].token_ids, "high": out[1].token_ids}


def drive(engine: LLMEngine, until: set[str], order: list[str], tokens: dict[str, list[int]]) -> None:
    while until - set(order):
        for out in engine.step():
            tokens.setdefault(out.rid, []).extend(out.token_ids)
            if out.finished:
                order.append(out.rid)


def test_high_priority_preempts_and_the_victim_is_recomputed_exactly(tiny_llama, alone):
    engine = make(tiny_llama, max_running_requests=1, priority_preemption_threshold=5)
    engine.add_request(LOW, GREEDY, "low", priority=0)
    tokens: dict[str, list[int]] = {}
    for _ in range(3):  # prefill + two decode steps: "low" is running with 3 tokens
        for out in engine.step():
            tokens.setdefault(out.rid, []).extend(out.token_ids)
    engine.add_request(HIGH, GREEDY, "high", priority=6)
    order: list[str] = []
    drive(engine, {"low", "high"}, order, tokens)
    assert order == ["high", "low"]
    assert engine.scheduler.num_preemptions == 1
    assert tokens["high"] == alone["high"] and tokens["low"] == alone["low"]  # the recompute loses nothing
    engine.check_idle()


def test_within_the_threshold_nothing_is_preempted(tiny_llama, alone):
    engine = make(tiny_llama, max_running_requests=1, priority_preemption_threshold=10)
    engine.add_request(LOW, GREEDY, "low", priority=0)
    engine.step()
    engine.add_request(HIGH, GREEDY, "high", priority=10)
    order: list[str] = []
    drive(engine, {"low", "high"}, order, {})
    assert order == ["low", "high"] and engine.scheduler.num_preemptions == 0
    engine.check_idle()


def test_full_queue_turns_away_the_lowest_and_frees_it(tiny_llama):
    engine = make(tiny_llama, max_running_requests=1, max_queued_requests=1, priority_preemption_threshold=100)
    engine.add_request(LOW, GREEDY, "running", priority=0)
    engine.step()
    engine.add_request(LOW, GREEDY, "queued-low", priority=1)
    with pytest.raises(ResourceExhausted, match="lower priority than this one \\(1\\)"):
        engine.add_request(LOW, GREEDY, "late-low", priority=1)
    engine.add_request(HIGH, GREEDY, "queued-high", priority=2)
    [(rid, err)] = engine.take_evicted()
    assert rid == "queued-low" and "higher priority (2)" in str(err)
    order: list[str] = []
    drive(engine, {"running", "queued-high"}, order, {})
    assert order == ["running", "queued-high"] and not engine.has_unfinished()
    engine.check_idle()
