"""The engine's Python API: bad input gets a clear error and changes nothing; streaming; sampling."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.errors import InvalidRequest, ModelNotFound
from tandem.engine.outputs import FinishReason
from tandem.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32", page_size=4, max_total_tokens=1024,
                                  context_length=128))


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ("", SamplingParams(max_tokens=4), "prompt"),
        ([], SamplingParams(max_tokens=4), "prompt"),
        (list(range(3, 131)), SamplingParams(max_tokens=4), "prompt"),       # 128 tokens >= context
        (list(range(3, 103)), SamplingParams(max_tokens=40), "max_tokens"),  # 100 + 40 > 128
        ([5, 6], SamplingParams(max_tokens=0), "max_tokens"),
        ([5, 6], SamplingParams(temperature=-0.5), "temperature"),
        ([5, 6], SamplingParams(top_p=0.0), "top_p"),
        ([5, 6], SamplingParams(top_p=1.5), "top_p"),
        ([5, 99999], SamplingParams(max_tokens=2), "prompt"),                  # token id outside the vocab
    ],
)
def test_bad_input_is_rejected_and_changes_nothing(engine, prompt, params, param):
    with pytest.raises(InvalidRequest) as e:
        engine.add_request(prompt, params)
    assert e.value.param == param and str(e.value)
    assert not engine.has_unfinished()
    engine.check_idle()
    # The engine still serves a good request afterwards.
    [res] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(res.token_ids) == 3


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelNotFound):
        LLMEngine(EngineConfig(model=str(tmp_path / "nope")))
    with pytest.raises(ModelNotFound):
        LLMEngine(EngineConfig(model="no-such-alias"))


def test_bad_engine_config_is_rejected(tiny_llama):
    with pytest.raises(InvalidRequest) as e:
        LLMEngine(EngineConfig(model=str(tiny_llama), page_size=3))
    assert e.value.param == "page_size"


def test_stream_deltas_add_up_to_generate(engine):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    deltas = list(engine.stream("hello world", params))
    [whole] = engine.generate(["hello world"], params)
    assert "".join(d.text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert deltas[-1].finish_reason is FinishReason.LENGTH and deltas[-1].usage.completion_tokens == 12
    assert all(not d.finished for d in deltas[:-1])
    engine.check_idle()


def test_stream_closed_early_frees_resources(engine):
    gen = engine.stream([5, 6, 7, 8], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    next(gen)
    gen.close()
    assert not engine.has_unfinished()
    engine.check_idle()


def test_abort_mid_generation(engine):
    rid = engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.abort(rid)
    assert not engine.abort(rid)
    engine.check_idle()


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    [alone] = engine.generate([[9, 8, 7]], params)
    others = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    batch = engine.generate([[1, 2, 3, 4], [9, 8, 7], [4, 4]], [others, params, others])
    assert batch[1].token_ids == alone.token_ids
    different = engine.generate([[9, 8, 7]], dataclasses.replace(params, seed=99))[0]
    assert different.token_ids != alone.token_ids


def test_stop_token_ids_and_stop_strings(engine):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    [ref] = engine.generate([[11, 12, 13]], params)
    stop_tok = ref.token_ids[4]
    first = ref.token_ids.index(stop_tok)
    [res] = engine.generate([[11, 12, 13]], dataclasses.replace(params, stop_token_ids=(stop_tok,)))
    assert res.token_ids == ref.token_ids[: first + 1]
    assert res.finish_reason is FinishReason.STOP and res.matched_stop == stop_tok
    # A stop string taken from the reference text cuts the text right before it.
    text = ref.text
    start = next(i for i in range(len(text) // 2, len(text) - 3) if text[i:i + 3].strip())
    stop = text[start:start + 3]
    [cut] = engine.generate([[11, 12, 13]], dataclasses.replace(params, stop=(stop,)))
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason is FinishReason.STOP and cut.matched_stop == stop
    engine.check_idle()


def test_eos_stops_with_no_matched_stop(engine, monkeypatch):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    [ref] = engine.generate([[11, 12, 13]], params)
    # Make a token the greedy path produces the model's EOS: it ends the output like EOS does.
    eos = ref.token_ids[3]
    monkeypatch.setattr(engine, "eos_token_ids", frozenset({eos}))
    [res] = engine.generate([[11, 12, 13]], dataclasses.replace(params, ignore_eos=False))
    assert res.token_ids == ref.token_ids[: ref.token_ids.index(eos) + 1]
    assert res.finish_reason is FinishReason.STOP and res.matched_stop is None
    engine.check_idle()


def test_logprobs(engine):
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3)
    [res] = engine.generate([[3, 4, 5]], params)
    assert len(res.logprobs) == 5
    for lp, tok in zip(res.logprobs, res.token_ids, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy picks the most likely token
        assert abs(lp.top[0][1] - lp.logprob) < 1e-5
