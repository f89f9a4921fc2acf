"""Constrained decoding through the engine on the tiny random model (its byte-level tokenizer can
write any JSON): outputs obey the constraint with greedy, seeded and top-k/top-p sampling; greedy
tokens are the same with overlap scheduling and with n-gram speculation; a dead end ends with its
own finish reason; a bad constraint is refused at admission. Every run ends idle."""

from __future__ import annotations

import json
import re

import pytest

from tandem.engine.errors import GrammarViolation, InvalidRequest
from tandem.engine.outputs import FinishReason
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.batch import SampledToken
from tandem.engine.structured_output import Kind, StructuredSpec
from tests.engine.test_engine_vs_hf import make_engine, random_prompts

# Bounded strings and numbers: a random-weight model completes it within max_tokens.
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    "kind": {"enum": ["a", "b"]},
    "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}},
    "required": ["id", "tags", "kind", "inner"], "additionalProperties": False}
PROMPTS = random_prompts([7, 19, 4, 30], 512, seed=5)


def check_schema(value: dict) -> None:
    assert set(value) == {"id", "tags", "kind", "inner"}
    assert isinstance(value["id"], int) and 0 <= value["id"] <= 999
    assert len(value["tags"]) <= 2 and all(isinstance(t, str) and len(t) <= 4 for t in value["tags"])
    assert value["kind"] in ("a", "b") and value["inner"] == {"ok": value["inner"]["ok"]}


def run(engine, params, prompts=PROMPTS):
    out = engine.generate(prompts, params)
    engine.check_idle()
    return out


def schema_params(**kw) -> SamplingParams:
    kw.setdefault("temperature", 0)
    return SamplingParams(max_tokens=120, structured=StructuredSpec.json_schema(SCHEMA), **kw)


@pytest.fixture(scope="module")
def plain(tiny_llama):
    e = make_engine(tiny_llama, enable_overlap_schedule=False)
    yield e
    e.close()


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.9, seed=7), dict(temperature=1.0, top_k=20, top_p=0.9),
                                dict(temperature=0.7, logprobs=True, top_logprobs=3)],
                         ids=["greedy", "seeded", "topk-topp", "logprobs"])
def test_schema_is_obeyed(plain, kw):
    for r in run(plain, schema_params(**kw)):
        assert r.finish_reason is FinishReason.STOP, r.text
        check_schema(json.loads(r.text))
        if kw.get("logprobs"):
            assert len(r.logprobs) == len(r.token_ids) and all(len(lp.top) == 3 for lp in r.logprobs)


def test_seeded_runs_repeat(plain):
    a = run(plain, schema_params(temperature=1.0, seed=11))
    b = run(plain, schema_params(temperature=1.0, seed=11))
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_free_and_constrained_requests_share_a_batch(plain):
    params = [schema_params(), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 2
    out = plain.generate(PROMPTS, params)
    plain.check_idle()
    alone = plain.generate(PROMPTS[1:2], params[1])[0]
    assert out[1].token_ids == alone.token_ids   # the free row is untouched by its neighbours' masks
    check_schema(json.loads(out[0].text))


def test_regex_and_choice(plain):
    for r in run(plain, SamplingParams(max_tokens=30, temperature=1.0, seed=3,
                                       structured=StructuredSpec(Kind.REGEX, r"[0-9]{3}-[a-z]{2,4}"))):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", r.text), r.text
    choices = ("red", "green", "blue sky")
    for r in run(plain, SamplingParams(max_tokens=10, temperature=1.0, seed=4,
                                       structured=StructuredSpec(Kind.CHOICE, choices))):
        assert r.text in choices and r.finish_reason is FinishReason.STOP


def test_dead_end_has_its_own_finish_reason(plain):
    spec = StructuredSpec(Kind.GRAMMAR, 'start: "a" b\nb: b "c"\n')   # nothing can follow "a"
    r = run(plain, SamplingParams(max_tokens=10, temperature=0, structured=spec), PROMPTS[:1])[0]
    assert r.finish_reason is FinishReason.GRAMMAR_DEAD_END and r.text == "a"


def test_bad_constraint_is_refused_at_admission(plain):
    with pytest.raises(InvalidRequest) as e:
        plain.add_request([1, 2, 3], SamplingParams(structured=StructuredSpec.json_schema("{")))
    assert e.value.param == "structured.json_schema"
    plain.check_idle()


def test_decode_start_refuses_a_first_token_the_grammar_does_not_allow(plain):
    spec = StructuredSpec(Kind.REGEX, "[0-9]+")
    req = plain.make_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0, structured=spec), "d1")
    letter = plain.tokenizer.encode("x", add_special_tokens=False)[0]
    with pytest.raises(GrammarViolation):
        plain.start_decoding(req, SampledToken(letter))
    assert req.output_ids == []
    plain.forget("d1")
    plain.check_idle()


@pytest.mark.parametrize("variant", ["overlap", "ngram", "overlap-tight"])
def test_greedy_tokens_equal_plain_steps(tiny_llama, plain, variant):
    kw = {"overlap": dict(enable_overlap_schedule=True),
          "ngram": dict(speculative_algorithm="ngram", speculative_ngram_min=1, speculative_ngram_max=3,
                        speculative_adaptive=False),
          # a pool so small that requests are retracted and recomputed mid-output
          "overlap-tight": dict(enable_overlap_schedule=True, max_total_tokens=160, chunked_prefill_size=16,
                                init_new_token_ratio=0.01, min_new_token_ratio=0.01)}[variant]
    other = make_engine(tiny_llama, **kw)
    want = run(plain, schema_params())
    got = run(other, schema_params())
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    if variant == "ngram":
        assert other.spec.stats.verify_steps > 0
    if variant == "overlap-tight":
        assert other.scheduler.num_retractions > 0
    other.close()
