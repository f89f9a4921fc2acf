"""Structured output across prefill and decode workers (one process, real tcp transfer): P samples
the first token under the grammar, D resumes the matcher from it; greedy tokens equal the co-located
engine's, for remote and local (conditional disaggregation) prefill; a first token the grammar
refuses fails the request on D instead of being output."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tandem.engine.engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import Kind, StructuredSpec
from tandem.services.decode.worker import DecodeRoom, DecodeTimeouts
from tandem.services.prefill.worker import PrefillTimeouts
from tests.engine.structured.test_structured_engine import SCHEMA, check_schema
from tests.services.test_pd_workers import BASE, drive, make_pair, submit

PARAMS = SamplingParams(max_tokens=120, temperature=0, structured=StructuredSpec.json_schema(SCHEMA))


@pytest.fixture
def pair(tiny_llama):
    prefill, decode, peers = make_pair(tiny_llama, PrefillTimeouts(bootstrap_s=5.0, transfer_s=10.0),
                                       DecodeTimeouts(transfer_s=10.0))
    yield prefill, decode, peers
    prefill.sender.close()
    peers.receiver.close()


def test_schema_output_equals_colocated_remote_and_local(pair, tiny_llama):
    prefill, decode, _ = pair
    remote = [list(range(3, 3 + n)) for n in (5, 23)]
    local = list(range(40, 61))
    results, responses = {}, []
    for i, p in enumerate(remote):
        submit(prefill, decode, 10 + i, p, PARAMS, results, responses)
    decode.add_local(DecodeRoom(0, decode.engine.make_request(local, PARAMS, "l1"), "", "",
                                results.setdefault("l1", []).append))
    drive(prefill, decode, lambda: len(responses) == 2 and not decode.streams, timeout_s=60)
    ref = LLMEngine(dataclasses.replace(BASE, model=str(tiny_llama))).generate([*remote, local], PARAMS)
    for rid, want in zip(("r10", "r11", "l1"), ref, strict=True):
        outs = results[rid]
        assert [t for o in outs for t in o.token_ids] == want.token_ids
        check_schema(json.loads("".join(o.text for o in outs)))
    prefill.engine.check_idle()
    decode.engine.check_idle()


def test_decode_refuses_a_first_token_outside_the_grammar(pair):
    # P is asked for free text while D holds the constraint: P's first token is not a digit, and D
    # must fail the request rather than output it.
    prefill, decode, _ = pair
    digits = SamplingParams(max_tokens=8, temperature=0, structured=StructuredSpec(Kind.REGEX, "[0-9]+"))
    prompt = [5, 6, 7, 8]
    first = prefill.engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0].text
    assert not first[:1].isdigit()
    results, responses = {}, []
    prefill.add_prefill(1, "r1", prompt, SamplingParams(max_tokens=8, temperature=0), responses.append)
    req = decode.engine.make_request(prompt, digits, "r1")
    decode.add(DecodeRoom(1, req, "p:0", "p", results.setdefault("r1", []).append))
    drive(prefill, decode, lambda: results.get("r1") and not decode.streams and responses, timeout_s=30)
    assert len(results["r1"]) == 1 and isinstance(results["r1"][0], Exception)
    assert "not allowed by the request's structured-output constraint" in str(results["r1"][0])
    prefill.engine.check_idle()
    decode.engine.check_idle()
