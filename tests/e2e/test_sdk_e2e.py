"""tandem_client (sync and asyncio) against the live 1P1D stack the gateway e2e tests share."""

from __future__ import annotations

import asyncio

import openai
import pytest
from tandem_client import AsyncClient, Client, FinishReason, InvalidRequestError, ModelNotFoundError

from tests.e2e.stack import API_KEY, gateway_stack

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def stack(request, tiny_llama):
    return gateway_stack(request.config, tiny_llama)


def assert_pages_free(stack):
    for w in stack.info["workers"]:
        free, total = stack.wait_pages_free(w)
        assert free == total, f"{w['worker_id']} still holds pages: {free}/{total}"


def test_sync_generate_and_stream_agree_with_the_gateway(stack, tiny_llama):
    assert stack.info["router_metrics_port"] > 0  # `tandem up --ready-json` reports the router's metrics
    prompt = "the capital of France is"
    with Client(stack.info["router"], timeout=60, api_key=API_KEY) as client:
        result = client.generate(prompt, max_tokens=10, temperature=0, ignore_eos=True)
        assert result.finish_reason is FinishReason.LENGTH and len(result.token_ids) == 10
        assert result.usage.completion_tokens == 10 and result.usage.prompt_tokens > 0
        chunks = list(client.stream(prompt, max_tokens=10, temperature=0, ignore_eos=True))
        assert "".join(c.text for c in chunks) == result.text
        assert [t for c in chunks for t in c.token_ids] == result.token_ids
        assert client.list_models()[0].id == str(tiny_llama)
        with pytest.raises(InvalidRequestError) as e:
            client.generate(prompt, max_tokens=5000)
        assert e.value.param == "max_tokens"
        with pytest.raises(ModelNotFoundError):
            client.generate(prompt, model="nope")
    with openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=API_KEY, max_retries=0) as http:
        same = http.completions.create(model=str(tiny_llama), prompt=prompt, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert same.choices[0].text == result.text and same.usage.prompt_tokens == result.usage.prompt_tokens


def test_stop_token_id_is_reported_through_router_sdk_and_gateway(stack, tiny_llama):
    prompt = "one two three"
    with Client(stack.info["router"], timeout=60, api_key=API_KEY) as client:
        ref = client.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True)
        tok = ref.token_ids[3]
        cut = client.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[tok])
    assert cut.finish_reason is FinishReason.STOP and cut.matched_stop == tok
    assert cut.token_ids == ref.token_ids[: ref.token_ids.index(tok) + 1]
    with openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=API_KEY, max_retries=0) as http:
        choice = http.completions.create(model=str(tiny_llama), prompt=prompt, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True, "stop_token_ids": [tok]}).choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == tok


def test_async_generate_stream_and_cancel(stack):
    decode = stack.workers("decode")[0]
    cancelled = stack.worker_requests(decode).get("cancelled", 0)

    async def body():
        async with AsyncClient(stack.info["router"], timeout=60, api_key=API_KEY) as client:
            results = await asyncio.gather(*(client.generate([5, 6, 7 + i], max_tokens=6, temperature=0,
                                                             ignore_eos=True) for i in range(3)))
            assert [len(r.token_ids) for r in results] == [6, 6, 6]
            got = 0
            async with client.stream([9, 10, 11], max_tokens=480, ignore_eos=True) as stream:
                async for chunk in stream:
                    got += len(chunk.token_ids)
                    if got >= 3:
                        break  # leaving the block cancels the call
            assert got < 480

    asyncio.run(body())
    assert_pages_free(stack)
    assert stack.worker_requests(decode).get("cancelled", 0) == cancelled + 1


def test_sync_cancelled_stream_frees_pages(stack):
    decode = stack.workers("decode")[0]
    cancelled = stack.worker_requests(decode).get("cancelled", 0)
    with Client(stack.info["router"], api_key=API_KEY) as client:
        stream = client.stream(list(range(3, 60)), max_tokens=450, ignore_eos=True)
        got = 0
        for chunk in stream:
            got += len(chunk.token_ids)
            if got >= 3:
                stream.cancel()
        assert got < 450
    assert_pages_free(stack)
    assert stack.worker_requests(decode).get("cancelled", 0) == cancelled + 1
