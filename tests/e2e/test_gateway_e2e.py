"""The official `openai` package against a live 1P1D stack through the HTTP gateway.

Completions and chat, streaming and not, stop strings, seeds, usage equal to the tokenizer's
counts, greedy text equal to `tandem generate`, every error status, and a client that hangs up
mid-stream freeing its pages on both workers.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from tandem_client import Client
from transformers import AutoTokenizer

from tandem.cli import main as cli
from tests.e2e.stack import API_KEY, Service, gateway_stack

pytestmark = pytest.mark.timeout(180)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def stack(request, tiny_llama):
    return gateway_stack(request.config, tiny_llama)


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def model(tiny_llama) -> str:
    return str(tiny_llama)  # the served model's id: what the workers were started with


def test_completions_and_chat_streaming_and_not_with_exact_usage(client, tokenizer, model):
    prompt = "the capital of France is"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt)) and full.usage.completion_tokens == 12

    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens and chunks[-1].usage.completion_tokens == 12

    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2)
    chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert chat.usage.prompt_tokens == len(chat_ids)
    assert chat.usage.completion_tokens == len(chat.choices[0].logprobs.content) <= 8
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)
    streamed = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content
    assert streamed[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_greedy_text_equals_tandem_generate(client, model, capsys):
    prompt = "hello world, the first page"
    http = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    # `tandem generate` itself, run in this process (torch is already imported here).
    assert cli.main(["generate", "--model", model, "--dtype", "float32", "--max-total-tokens", "1024",
                     "--prompt", prompt, "--max-tokens", "16", "--ignore-eos", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == http + "\n"


def test_stop_strings_and_seeds(client, model):
    prompt = "one two three four"
    text = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = text[6:9]
    cut = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "@@"],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop)]
    assert cut.model_extra["stop_reason"] == stop

    def sample(seed):
        return client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=1.0,
                                              seed=seed, n=2).choices

    first, again = sample(42), sample(42)
    assert [c.message.content for c in first] == [c.message.content for c in again]
    assert first[0].message.content != first[1].message.content  # choice i samples with seed + i


def test_error_statuses(client, stack, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="word " * 600, max_tokens=4)
    assert e.value.body["param"] == "prompt" and "context length" in e.value.body["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert e.value.body["code"] == "model_not_found"


@pytest.fixture(scope="module")
def side_gateways(stack):
    """Two more router+gateway pairs on the stack's Redis: one whose router admits one request at a
    time, one whose router sees no workers (another registry prefix)."""
    redis = stack.info["redis_url"]
    routers = [Service("tandem.cli", "router", "--port", "0", "--redis-url", redis, "--metrics-port", "-1", *extra)
               for extra in (("--max-inflight", "1"), ("--registry-prefix", "nobody"))]
    services = list(routers)
    try:
        addrs = [r.wait_ready()["grpc_addr"] for r in routers]
        gateways = [Service("tandem.services.gateway", "--port", "0", "--router", a) for a in addrs]
        services += gateways
        yield [(a, g.wait_ready()["url"]) for a, g in zip(addrs, gateways, strict=True)]
    finally:
        for s in services:
            s.close()


def test_full_queues_are_429_and_no_workers_is_503(side_gateways, model):
    (busy_router, busy_url), (_, empty_url) = side_gateways
    with Client(busy_router) as sdk, openai.OpenAI(base_url=busy_url + "/v1", api_key="x", max_retries=0) as busy:
        with sdk.stream([5, 6, 7], max_tokens=480, ignore_eos=True) as hog:  # takes the router's only slot
            next(hog)
            with pytest.raises(openai.RateLimitError) as e:
                busy.completions.create(model=model, prompt="x", max_tokens=2)
            assert "in flight" in e.value.body["message"]
    with openai.OpenAI(base_url=empty_url + "/v1", api_key="x", max_retries=0) as empty:
        with pytest.raises(openai.InternalServerError) as e:
            empty.completions.create(model=model, prompt="x", max_tokens=2)
    assert e.value.status_code == 503 and "no workers" in e.value.body["message"]
    assert httpx.get(empty_url + "/health").status_code == 503


def test_client_disconnect_cancels_and_frees_pages(stack, model):
    assert httpx.get(stack.gateway_url + "/health").status_code == 200
    decode = stack.workers("decode")[0]
    cancelled = stack.worker_requests(decode).get("cancelled", 0)
    body = {"model": model, "prompt": "a b c d e f g h", "max_tokens": 480, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", stack.gateway_url + "/v1/completions", json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # The connection is closed: the gateway cancels the router call, the router both workers' rooms.
    for w in stack.info["workers"]:
        free, total = stack.wait_pages_free(w)
        assert free == total, f"{w['worker_id']} still holds pages: {free}/{total}"
    assert stack.worker_requests(decode).get("cancelled", 0) == cancelled + 1
