"""The gateway's request limits over HTTP (in front of a fake router): 413 for a body over
--max-request-bytes, declared or streamed, and 400 naming the parameter for the other limits;
nothing over a limit reaches the router."""

from __future__ import annotations

import asyncio

import pytest

from tandem.services.common.limits import RequestLimits
from tests.sdk.fake_router import FakeRouter
from tests.services.gateway.conftest import MODEL, MODELS, gateway_client

pytestmark = pytest.mark.timeout(60)

LIMITS = RequestLimits(max_request_bytes=2048, max_input_tokens=6, max_output_tokens=10, max_stop_sequences=2,
                       max_stop_length=4)


@pytest.fixture
def fake():
    with FakeRouter(models=MODELS) as f:
        yield f


def _post_all(fake, tiny_llama, posts):
    async def body():
        async with gateway_client(fake.addr, str(tiny_llama), limits=LIMITS, max_n=3) as (client, _):
            return [await client.post(path, **kw) for path, kw in posts]

    return asyncio.run(body())


async def _chunks(data: bytes):
    """A body without Content-Length (chunked): only counting what arrives can stop it."""
    for i in range(0, len(data), 512):
        yield data[i:i + 512]


def test_bodies_over_the_limit_are_413_declared_or_streamed(fake, tiny_llama):
    big = b'{"model": "tiny", "prompt": "' + b"a" * 3000 + b'"}'
    r_declared, r_streamed, r_small = _post_all(fake, tiny_llama, [
        ("/v1/completions", dict(content=big, headers={"content-type": "application/json"})),
        ("/v1/completions", dict(content=_chunks(big), headers={"content-type": "application/json"})),
        ("/v1/completions", dict(json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2})),
    ])
    for r in (r_declared, r_streamed):
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large" and "--max-request-bytes" in r.json()["error"]["message"]
    assert r_small.status_code == 200, r_small.text
    assert len(fake.requests) == 1


def test_each_limit_is_a_400_naming_its_parameter(fake, tiny_llama):
    cases = {
        "prompt": ("/v1/completions", {"prompt": [1, 2, 3, 4, 5, 6, 7], "max_tokens": 2}),
        "max_tokens": ("/v1/completions", {"prompt": [1], "max_tokens": 11}),
        "max_completion_tokens": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                           "max_completion_tokens": 11}),
        "stop": ("/v1/completions", {"prompt": [1], "max_tokens": 2, "stop": ["a", "b", "c"]}),
        "stop length": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2, "stop": "abcde"}),
        "messages": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a b c d e f g h i j"}],
                                              "max_tokens": 2}),
        "n": ("/v1/completions", {"prompt": [1], "max_tokens": 2, "n": 4}),
    }
    responses = _post_all(fake, tiny_llama, [(path, dict(json={"model": MODEL, **body}))
                                             for path, body in cases.values()])
    got = {name: (r.status_code, r.json()["error"]["param"]) for name, r in zip(cases, responses, strict=True)}
    assert got == {"prompt": (400, "prompt"), "max_tokens": (400, "max_tokens"),
                   "max_completion_tokens": (400, "max_completion_tokens"), "stop": (400, "stop"),
                   "stop length": (400, "stop"), "messages": (400, "messages"), "n": (400, "n")}
    assert not fake.requests                                      # nothing over a limit reached the router
