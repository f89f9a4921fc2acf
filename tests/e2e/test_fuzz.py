"""Property-based fuzzing of the public APIs of a real deployment (gateway -> router -> 1P1D, tiny
model): generated OpenAI JSON bodies over HTTP and generated `GenerateRequest`s over gRPC, from
valid requests with a field or two broken to plain garbage. Whatever arrives: no 5xx (no INTERNAL /
UNKNOWN on gRPC) — 503 / 429 only where they are true — every stream ends, and afterwards every
worker is idle with all its KV pages free and no failed idle self-check. The fast suite runs a few
dozen cases per API; the slow one well over a thousand in all."""

from __future__ import annotations

import json
import math
import re
import urllib.request
from collections import Counter

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.v1 import generation_pb2, generation_pb2_grpc
from tests.e2e.stack import API_KEY, gateway_stack

pytestmark = pytest.mark.timeout(1800)

FAST_CASES = 40
SLOW_HTTP_CASES = 700
SLOW_GRPC_CASES = 500
HTTP_OK = {200, 400, 404, 413}          # + 429 / 503, accepted only when the server is in fact busy / empty
GRPC_OK = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
HTTP_BUSY, GRPC_BUSY = 429, grpc.StatusCode.RESOURCE_EXHAUSTED

# ---- strategies --------------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=12)
           | st.floats(allow_nan=True, allow_infinity=True))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)
small_tokens = st.integers(0, 6)
floats = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-3, 3) | st.sampled_from([0.0, 0.5, 1.0, 2.0])
token_ids = st.lists(st.integers(-5, 2**33), min_size=0, max_size=12) | st.lists(st.integers(0, 200), max_size=12)
text = st.text(max_size=40) | st.sampled_from(["", "hello", "the capital of France is", "\x00", "é" * 30])

SAMPLING_FIELDS = {
    "temperature": floats, "top_p": floats, "top_k": st.integers(-3, 100) | json_values, "min_p": floats,
    "presence_penalty": floats, "frequency_penalty": floats, "repetition_penalty": floats,
    "seed": st.integers(-(2**70), 2**70) | json_values, "n": st.integers(-2, 20) | json_values,
    "stop": text | st.lists(text, max_size=20) | json_values,
    "stop_token_ids": st.lists(st.integers(-3, 2**33), max_size=6) | json_values,
    "ignore_eos": st.booleans() | json_values, "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | json_values}) | json_values,
    "priority": st.integers(-(2**40), 2**40) | json_values, "logit_bias": json_values,
    "skip_special_tokens": st.booleans() | json_values, "user": text | json_values,
}
COMPLETION_FIELDS = {**SAMPLING_FIELDS, "prompt": text | token_ids | st.lists(text | token_ids, max_size=3) | json_values,
                     "max_tokens": small_tokens | st.integers(-(2**40), 2**40) | json_values,
                     "logprobs": st.integers(-2, 8) | json_values, "echo": st.booleans(), "suffix": text,
                     "best_of": st.integers(-1, 5)}
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]) | json_values,
     "content": text | st.lists(st.fixed_dictionaries({"type": st.just("text") | text, "text": text}), max_size=2)
     | json_values}), max_size=3) | json_values
CHAT_FIELDS = {**SAMPLING_FIELDS, "messages": messages, "max_tokens": small_tokens | json_values,
               "max_completion_tokens": small_tokens | st.integers(-(2**40), 2**40),
               "logprobs": st.booleans() | json_values, "top_logprobs": st.integers(-2, 30) | json_values,
               "tools": json_values, "response_format": json_values, "chat_template_kwargs": json_values}


def _mutated(model: str, base: dict, fields: dict) -> st.SearchStrategy[dict]:
    """`base` with up to three fields replaced (or added) from `fields`, or dropped."""
    keys = sorted(fields)

    @st.composite
    def build(draw):
        body = dict(base, model=draw(st.just(model) | st.just(model) | text))
        for key in draw(st.lists(st.sampled_from(keys), max_size=3, unique=True)):
            if draw(st.integers(0, 5)) == 0:
                body.pop(key, None)
            else:
                body[key] = draw(fields[key])
        return body

    return build()


def http_cases(model: str) -> st.SearchStrategy[tuple[str, bytes]]:
    """(path, body bytes): mostly mutated valid requests, some arbitrary JSON, some not JSON at all."""
    completion = {"prompt": "the capital of France is", "max_tokens": 3}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    as_json = st.builds(lambda d: json.dumps(d).encode(), _mutated(model, completion, COMPLETION_FIELDS))
    chat_json = st.builds(lambda d: json.dumps(d).encode(), _mutated(model, chat, CHAT_FIELDS))
    garbage = (st.builds(lambda v: json.dumps(v).encode(), json_values) | st.binary(max_size=64)
               | st.just(b'{"model": "x", "prompt": "\\udbff", "max_tokens": 2}'))   # a lone surrogate
    return st.one_of(st.tuples(st.just("/v1/completions"), as_json | garbage),
                     st.tuples(st.just("/v1/chat/completions"), chat_json | garbage))


GRPC_SAMPLING = {   # field -> (a valid value, wild values)
    "temperature": (0.0, st.floats(width=32)), "top_p": (1.0, st.floats(width=32)),
    "top_k": (0, st.integers(-(2**31), 2**31 - 1)), "min_p": (0.0, st.floats(width=32)),
    "repetition_penalty": (1.0, st.floats(width=32)), "frequency_penalty": (0.0, st.floats(width=32)),
    "presence_penalty": (0.0, st.floats(width=32)), "max_tokens": (3, small_tokens | st.integers(0, 2**32 - 1)),
    "stop": ([], st.lists(text, max_size=20)), "stop_token_ids": ([], st.lists(st.integers(0, 2**32 - 1), max_size=5)),
    "ignore_eos": (False, st.booleans()), "top_logprobs": (0, st.integers(0, 40) | st.integers(0, 2**32 - 1)),
    "logprobs": (False, st.booleans()), "seed": (None, st.integers(0, 2**64 - 1)),
    "skip_special_tokens": (None, st.booleans()),
}


@st.composite
def grpc_requests(draw, model: str) -> generation_pb2.GenerateRequest:
    """A valid request with up to three sampling fields wild, and a prompt/model/priority of any kind."""
    values = {k: valid for k, (valid, _) in GRPC_SAMPLING.items()}
    for key in draw(st.lists(st.sampled_from(sorted(GRPC_SAMPLING)), max_size=3, unique=True)):
        values[key] = draw(GRPC_SAMPLING[key][1])
    sampling = generation_pb2.SamplingParams(**{k: v for k, v in values.items() if v is not None})
    req = generation_pb2.GenerateRequest(request_id=draw(st.just("") | text), model=draw(st.just(model) | text),
                                         sampling=sampling,
                                         priority=draw(st.just(0) | st.integers(-(2**63), 2**63 - 1)))
    kind = draw(st.sampled_from(["text", "ids", "ids", "none"]))
    if kind == "text":
        req.text = draw(text)
    elif kind == "ids":
        req.token_ids.ids.extend(draw(st.lists(st.integers(0, 200), min_size=1, max_size=12)
                                      | st.lists(st.integers(0, 2**32 - 1), max_size=12)))
    return req


# ---- the properties --------------------------------------------------------------------------------

def _check_http(client: httpx.Client, path: str, body: bytes) -> int:
    with client.stream("POST", path, content=body, headers={"content-type": "application/json"}) as r:
        if r.status_code != 200 or not r.headers.get("content-type", "").startswith("text/event-stream"):
            r.read()
            if r.status_code >= 500:
                assert r.status_code == 503 and "no workers" in r.text, (r.status_code, r.text, body)
            assert r.status_code in HTTP_OK | {HTTP_BUSY, 503}, (r.status_code, r.text, body)
            return r.status_code
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", (events[-3:], body)
    for e in events[:-1]:
        err = json.loads(e).get("error")
        assert err is None or err.get("type") != "internal_error", (err, body)
    return 200


def _check_grpc(stub, req: generation_pb2.GenerateRequest) -> grpc.StatusCode:
    meta = (("authorization", f"Bearer {API_KEY}"),)
    try:
        chunks = list(stub.Generate(req, timeout=120, metadata=meta))
    except grpc.RpcError as e:
        assert e.code() in GRPC_OK | {GRPC_BUSY}, (e.code(), e.details(), req)
        return e.code()
    assert chunks and chunks[-1].finish_reason, (chunks[-1:], req)
    return grpc.StatusCode.OK


def _assert_idle(stack) -> None:
    """Every worker: all pages free again, no idle self-check ever failed."""
    for w in stack.info["workers"]:
        free, total = stack.wait_pages_free(w, timeout_s=60)
        assert free == total, f"{w['worker_id']} leaked pages: {free}/{total} free"
        text = urllib.request.urlopen(f"http://127.0.0.1:{w['metrics_port']}/metrics", timeout=5).read().decode()
        failures = re.search(r"^tandem_idle_check_failures_total (\S+)", text, re.M)
        assert failures is None or math.isclose(float(failures.group(1)), 0.0), f"{w['worker_id']}: {failures}"


def fuzz_http(stack, model: str, cases: int) -> Counter:
    seen: Counter = Counter()
    with httpx.Client(base_url=stack.gateway_url, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        @settings(max_examples=cases, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(http_cases(model))
        def prop(case):
            seen[_check_http(client, *case)] += 1

        prop()
    _assert_idle(stack)
    return seen


def fuzz_grpc(stack, model: str, cases: int) -> Counter:
    seen: Counter = Counter()
    stub = generation_pb2_grpc.GenerationStub(stack.channel)

    @settings(max_examples=cases, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(grpc_requests(model))
    def prop(req):
        seen[_check_grpc(stub, req)] += 1

    prop()
    _assert_idle(stack)
    return seen


@pytest.fixture(scope="module")
def stack(request, tiny_llama):
    return gateway_stack(request.config, tiny_llama)


@pytest.fixture(scope="module")
def model(tiny_llama) -> str:
    return str(tiny_llama)


def test_gateway_json_fuzz(stack, model):
    seen = fuzz_http(stack, model, FAST_CASES)
    assert sum(seen.values()) == FAST_CASES and seen[400] > 0, seen


def test_grpc_api_fuzz(stack, model):
    seen = fuzz_grpc(stack, model, FAST_CASES)
    assert sum(seen.values()) == FAST_CASES and seen[grpc.StatusCode.INVALID_ARGUMENT] > 0, seen


@pytest.mark.slow
def test_fuzz_over_a_thousand_cases(stack, model):
    http, rpc = fuzz_http(stack, model, SLOW_HTTP_CASES), fuzz_grpc(stack, model, SLOW_GRPC_CASES)
    assert sum(http.values()) + sum(rpc.values()) >= 1000
    assert http[200] > 0 and http[400] > 0 and rpc[grpc.StatusCode.OK] > 0, (http, rpc)
