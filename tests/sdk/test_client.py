"""tandem_client (sync and asyncio) against an in-process fake router."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import grpc
import pytest
from tandem_client import (
    NO_RETRY,
    AsyncClient,
    Client,
    DeadlineExceededError,
    FinishReason,
    InvalidRequestError,
    ResourceExhaustedError,
    RetryPolicy,
    SamplingParams,
    TLSConfig,
    UnavailableError,
)

from tandem.v1 import generation_pb2 as pb
from tests.sdk.fake_router import FakeRouter, failing, tokens

pytestmark = pytest.mark.timeout(60)
FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.05)


def flaky(failures: int):
    """UNAVAILABLE for the first `failures` calls, then the default behaviour."""
    seen = []

    def handler(req, context):
        seen.append(1)
        if len(seen) <= failures:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no prefill workers are registered")
        yield from tokens(req, context)

    return handler


def test_generate_and_stream_map_requests_and_results():
    with FakeRouter(models=(pb.ModelInfo(id="m", max_context_len=64, vocab_size=9),)) as fake, \
            Client(fake.addr) as client:
        params = SamplingParams(max_tokens=3, temperature=0.0, top_k=-1, seed=5, stop=["\n"], logprobs=True,
                                top_logprobs=1)
        result = client.generate("hello world", params, model="m", request_id="r1")
        assert result.text == "t0 t1 t2 " and result.token_ids == [300, 301, 302]
        assert result.finish_reason is FinishReason.LENGTH
        assert result.usage.prompt_tokens == 2 and result.usage.completion_tokens == 3 and result.usage.total_tokens == 5
        assert result.logprobs[0].logprob == -0.5 and result.logprobs[0].top[0].token_id == 300
        req = fake.requests[0]
        assert (req.text, req.model, req.request_id) == ("hello world", "m", "r1")
        assert (req.sampling.top_k, req.sampling.seed, list(req.sampling.stop)) == (-1, 5, ["\n"])
        assert req.sampling.HasField("temperature") and not req.sampling.HasField("top_p")

        chunks = list(client.stream([1, 2, 3], max_tokens=2, ignore_eos=True))
        assert not fake.requests[1].sampling.HasField("temperature")   # the server's (the model's) default
        assert [c.text for c in chunks] == ["t0 ", "t1 "] and chunks[0].usage is None
        assert chunks[-1].finish_reason is FinishReason.LENGTH and chunks[-1].usage.prompt_tokens == 3
        assert list(fake.requests[1].token_ids.ids) == [1, 2, 3] and fake.requests[1].sampling.ignore_eos
        assert client.list_models()[0].max_context_len == 64
        with pytest.raises(TypeError):
            client.generate("x", bogus=1)
        client.generate("x", max_tokens=1, priority=-7)
        assert fake.requests[-1].priority == -7 and req.priority == 0
        with pytest.raises(TypeError, match="priority"):
            client.generate("x", priority="high")


@pytest.mark.parametrize("end", [{}, {"matched_stop": "\n"}, {"matched_stop_token_id": 0}])
def test_matched_stop_is_the_stop_string_or_token_id_and_none_for_eos(end):
    def handler(req, context):
        yield pb.GenerateResponse(request_id=req.request_id, token_ids=[5], text="a")
        yield pb.GenerateResponse(request_id=req.request_id, token_ids=[2], finish_reason=pb.FINISH_REASON_STOP,
                                  **end)

    with FakeRouter(handler) as fake, Client(fake.addr) as client:
        result = client.generate("hi", max_tokens=4)
    assert result.finish_reason is FinishReason.STOP
    assert result.matched_stop == next(iter(end.values()), None)
    assert type(result.matched_stop) is type(next(iter(end.values()), None))


def test_errors_carry_the_server_message_and_param():
    with FakeRouter(failing(grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1]", "top_p")) as fake, \
            Client(fake.addr, retry=FAST_RETRY) as client:
        with pytest.raises(InvalidRequestError) as e:
            client.generate("x", top_p=2.0)
        assert str(e.value) == "top_p must be in (0, 1]" and e.value.param == "top_p"
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and fake.calls == 1
    with FakeRouter(failing(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")) as fake, \
            Client(fake.addr, retry=FAST_RETRY) as client:
        with pytest.raises(ResourceExhaustedError, match="queue full"):
            client.generate("x")
        assert fake.calls == 1  # only UNAVAILABLE is retried


def test_unavailable_before_the_first_token_is_retried_with_backoff():
    with FakeRouter(flaky(2)) as fake, Client(fake.addr, retry=FAST_RETRY) as client:
        assert client.generate("x", max_tokens=2).text == "t0 t1 "
        assert fake.calls == 3
    with FakeRouter(flaky(2)) as fake, Client(fake.addr, retry=NO_RETRY) as client:
        with pytest.raises(UnavailableError, match="no prefill workers"):
            client.generate("x")
        assert fake.calls == 1


def test_no_retry_once_a_token_arrived():
    def handler(req, context):
        yield next(tokens(req, context))
        context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker died")

    with FakeRouter(handler) as fake, Client(fake.addr, retry=FAST_RETRY) as client:
        stream = client.stream("x", max_tokens=5)
        assert next(stream).text == "t0 "
        with pytest.raises(UnavailableError, match="decode worker died"):
            next(stream)
        assert fake.calls == 1


def test_deadline_covers_the_call():
    with FakeRouter(lambda req, ctx: tokens(req, ctx, delay_s=1.0)) as fake, Client(fake.addr, timeout=0.3) as client:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            client.generate("x", max_tokens=5)
        assert time.monotonic() - t0 < 1.0


def test_cancelled_stream_is_cancelled_on_the_server():
    with FakeRouter(lambda req, ctx: tokens(req, ctx, delay_s=0.05)) as fake, Client(fake.addr) as client:
        with client.stream("x", max_tokens=100) as stream:
            assert next(stream).text == "t0 "
        assert list(stream) == []  # leaving the block cancelled it
        assert fake.wait_cancelled(1)


def test_async_client():
    async def body(addr: str, fake: FakeRouter):
        async with AsyncClient(addr, retry=FAST_RETRY) as client:
            result = await client.generate("a b", max_tokens=2, seed=1, priority=3)
            assert fake.requests[-1].priority == 3
            assert result.text == "t0 t1 " and result.usage.completion_tokens == 2
            texts = [c.text async for c in client.stream([7], max_tokens=3)]
            assert texts == ["t0 ", "t1 ", "t2 "]
            async with client.stream("x", max_tokens=200) as stream:
                async for _ in stream:
                    break
            assert fake.wait_cancelled(1)
            assert [m.id for m in await client.list_models()] == []
            with pytest.raises(DeadlineExceededError):  # 100 tokens at 10 ms do not fit in 0.2 s
                await client.generate("x", max_tokens=100, timeout=0.2)

    with FakeRouter(lambda req, ctx: tokens(req, ctx, delay_s=0.01)) as fake:
        asyncio.run(body(fake.addr, fake))

    async def errors(addr: str):
        async with AsyncClient(addr, retry=FAST_RETRY) as client:
            assert (await client.generate("x", max_tokens=1)).text == "t0 "  # after 2 UNAVAILABLE

    with FakeRouter(flaky(2)) as fake:
        asyncio.run(errors(fake.addr))
        assert fake.calls == 3


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls(tmp_path):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost", "-keyout", str(tmp_path / "key.pem"),
                    "-out", str(tmp_path / "cert.pem")], check=True, capture_output=True, timeout=30)
    key, cert = (tmp_path / "key.pem").read_bytes(), (tmp_path / "cert.pem").read_bytes()
    creds = grpc.ssl_server_credentials([(key, cert)])
    with FakeRouter(server_credentials=creds) as fake:
        with Client(fake.addr, tls=TLSConfig(root_certificates=cert, server_name="localhost")) as client:
            assert client.generate("x", max_tokens=1).text == "t0 "
        with Client(fake.addr, retry=NO_RETRY, timeout=5) as plain:  # a plaintext client cannot talk to it
            with pytest.raises(UnavailableError):
                plain.generate("x", max_tokens=1)
