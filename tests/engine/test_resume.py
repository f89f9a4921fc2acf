"""`resume_ids` (the router's mid-stream migration): a request continued after k of its tokens on a
fresh engine emits exactly the tokens, and exactly the rest of the text, of an undisturbed run."""

from __future__ import annotations

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.errors import InvalidRequest
from tandem.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32", page_size=4, max_total_tokens=2048,
                                  context_length=128))


def _run(engine: LLMEngine, prompt, params: SamplingParams, resume=()) -> tuple[list[int], list[str]]:
    """Token ids and, after each of them, the text sent so far."""
    rid = engine.add_request(prompt, params, resume_ids=resume)
    ids, sent, done = [], [], False
    while not done:
        for out in engine.step():
            assert out.rid == rid
            text = (sent[-1] if sent else "") + out.text
            ids += out.token_ids
            sent += [text] * len(out.token_ids) if out.token_ids else []
            if out.text and not out.token_ids:
                sent[-1] = text
            done = out.finished
    return ids, sent


def _check_resumes(engine, prompt, params):
    ids, sent = _run(engine, prompt, params)
    for k in range(1, len(ids)):
        rest_ids, rest_sent = _run(engine, prompt, params, resume=ids[:k])
        assert ids[:k] + rest_ids == ids, k
        # What the client had after k tokens + the continuation's text = the undisturbed text: no
        # character twice, none missing (held-back stop-string prefixes, half characters included).
        assert sent[k - 1] + rest_sent[-1] == sent[-1], k
    engine.check_idle()
    return ids, sent


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=1.0, seed=11, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_resumed_run_continues_the_undisturbed_one(engine, params):
    _check_resumes(engine, list(range(30, 47)), params)


def test_held_back_stop_prefix_is_emitted_once(engine):
    prompt = list(range(60, 75))
    _, sent = _run(engine, prompt, SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))
    text = sent[-1]
    # A stop string that starts like a stretch of the output but never completes: that stretch is
    # held back by the detokenizer, then released; a resume in between must emit it exactly once.
    stop = text[3:7] + "\x00"
    _, held = _check_resumes(engine, prompt, SamplingParams(max_tokens=14, temperature=0, ignore_eos=True,
                                                            stop=[stop]))
    assert held[-1] == text
    assert any(h != s for h, s in zip(held, sent, strict=True))  # something was held back at some point


def test_nothing_left_to_resume_is_refused(engine):
    with pytest.raises(InvalidRequest):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0), resume_ids=[5, 6])
    engine.check_idle()
