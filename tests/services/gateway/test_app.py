"""The gateway's HTTP API against a fake router: request mapping, response shapes, errors, cancels."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from tandem.services.gateway.tokenizer import GatewayTokenizer
from tests.fixtures.model_folders import with_generation_config
from tests.sdk.fake_router import FakeRouter, failing, tokens
from tests.services.gateway.conftest import CONTEXT, MODEL, MODELS, gateway_client, sse_events

pytestmark = pytest.mark.timeout(60)


def run(fake: FakeRouter, tiny_llama, scenario, **config):
    async def body():
        async with gateway_client(fake.addr, str(tiny_llama), **config) as (client, gw):
            return await scenario(client, gw)

    return asyncio.run(body())


@pytest.fixture
def fake():
    with FakeRouter(models=MODELS) as f:
        yield f


def test_completion_maps_parameters_and_reports_usage(fake, tiny_llama):
    body = {"model": MODEL, "prompt": "the capital of France is", "max_tokens": 3, "temperature": 0.5,
            "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 11, "stop": "x", "presence_penalty": 0.5,
            "frequency_penalty": 0.25, "repetition_penalty": 1.1, "ignore_eos": True}

    async def scenario(client, gw):
        return await client.post("/v1/completions", json=body)

    r = run(fake, tiny_llama, scenario)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == MODEL
    assert out["choices"] == [{"index": 0, "text": "t0 t1 t2 ", "logprobs": None, "finish_reason": "length",
                               "stop_reason": None}]
    ids = GatewayTokenizer.from_folder(tiny_llama).encode(body["prompt"])
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 3
    assert out["usage"]["total_tokens"] == len(ids) + 3
    (req,) = fake.requests
    assert list(req.token_ids.ids) == ids and req.model == MODEL
    s = req.sampling
    assert (s.max_tokens, s.top_k, s.seed, list(s.stop), s.ignore_eos) == (3, 5, 11, ["x"], True)
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9) and s.min_p == pytest.approx(0.1)
    assert s.presence_penalty == pytest.approx(0.5) and s.frequency_penalty == pytest.approx(0.25)
    assert s.repetition_penalty == pytest.approx(1.1)
    assert req.priority == 0


def test_unset_sampling_fields_take_the_models_generation_config_and_explicit_ones_win(fake, tiny_llama, tmp_path):
    recommending = with_generation_config(tiny_llama, tmp_path / "model", temperature=0.6, top_p=0.9, top_k=20)

    async def scenario(client, gw):
        for body in ({"model": MODEL, "prompt": "a", "max_tokens": 2},
                     {"model": MODEL, "prompt": "a", "max_tokens": 2, "temperature": 0, "top_k": -1}):
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        chat = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "top_p": 0.5}
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200

    def sent() -> list[tuple]:
        out = [(round(s.temperature, 4), round(s.top_p, 4), s.top_k, round(s.min_p, 4), round(s.repetition_penalty, 4))
               for s in (r.sampling for r in fake.requests)]
        # every field set on the wire: the worker has nothing left to fill
        assert all(r.sampling.HasField(f) for r in fake.requests for f in ("temperature", "top_k", "min_p"))
        fake.requests.clear()
        return out

    run(fake, recommending, scenario)
    assert sent() == [(0.6, 0.9, 20, 0.0, 1.0), (0.0, 0.9, -1, 0.0, 1.0), (0.6, 0.5, 20, 0.0, 1.0)]
    run(fake, tiny_llama, scenario)                 # a folder that recommends nothing: OpenAI's defaults
    assert sent() == [(1.0, 1.0, -1, 0.0, 1.0), (0.0, 1.0, -1, 0.0, 1.0), (1.0, 0.5, -1, 0.0, 1.0)]


def test_priority_reaches_the_router(fake, tiny_llama):
    async def scenario(client, gw):
        return await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "priority": -(1 << 31)})

    assert run(fake, tiny_llama, scenario).status_code == 200
    assert [r.priority for r in fake.requests] == [-(1 << 31)]


def test_chat_stream_applies_template_and_ends_with_usage_and_done(fake, tiny_llama):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hello"}]}]

    async def scenario(client, gw):
        return await client.post("/v1/chat/completions", json={
            "messages": messages, "max_completion_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}})

    r = run(fake, tiny_llama, scenario)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "t0 "}
    assert chunks[1]["choices"][0]["delta"] == {"content": "t1 "}
    assert chunks[1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    tok = GatewayTokenizer.from_folder(tiny_llama)
    ids = tok.encode(tok.apply_chat_template([messages[0], {"role": "user", "content": "hello"}]),
                     add_special_tokens=False)
    assert list(fake.requests[0].token_ids.ids) == ids
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["prompt_tokens"] == len(ids) and usage_chunk["usage"]["completion_tokens"] == 2


def test_n_and_batched_prompts_fan_out_with_distinct_seeds(fake, tiny_llama):
    async def scenario(client, gw):
        return await client.post("/v1/completions", json={
            "prompt": ["a b", "c"], "n": 2, "max_tokens": 2, "seed": 7})

    out = run(fake, tiny_llama, scenario).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert sorted(r.sampling.seed for r in fake.requests) == [7, 7, 8, 8]
    tok = GatewayTokenizer.from_folder(tiny_llama)
    assert out["usage"]["prompt_tokens"] == len(tok.encode("a b")) + len(tok.encode("c"))  # once per prompt
    assert out["usage"]["completion_tokens"] == 8


def test_logprobs_in_both_openai_shapes(fake, tiny_llama):
    async def scenario(client, gw):
        legacy = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "logprobs": 2})
        chat = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 2})
        return legacy.json(), chat.json()

    legacy, chat = run(fake, tiny_llama, scenario)
    tok = GatewayTokenizer.from_folder(tiny_llama)
    lp = legacy["choices"][0]["logprobs"]
    assert lp["tokens"] == [tok.token_text(300), tok.token_text(301)]
    assert lp["token_logprobs"] == [-0.5, -0.5] and len(lp["top_logprobs"][0]) == 2
    assert lp["text_offset"] == [0, len(tok.token_text(300))]
    content = chat["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == tok.token_text(300) and content[0]["bytes"] == list(tok.token_text(300).encode())
    assert [t["logprob"] for t in content[1]["top_logprobs"]] == [-0.5, -1.5]


@pytest.mark.parametrize("endpoint, body, param", [
    ("completions", {"prompt": "a", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "a", "temperature": 2.5}, "temperature"),
    ("chat", {"messages": [{"role": "user", "content": "a"}], "temperature": 3}, "temperature"),
    ("completions", {"prompt": "a", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "a", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "a", "n": 0}, "n"),
    ("completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "a", "stop": [""]}, "stop"),
    ("completions", {"prompt": "a", "logit_bias": {"5": 1}}, "logit_bias"),
    ("completions", {"prompt": "a " * CONTEXT}, "prompt"),
    ("completions", {"prompt": [600]}, "prompt"),
    ("completions", {"prompt": "a", "max_tokens": CONTEXT}, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "a " * CONTEXT}]}, "messages"),
    ("chat", {"messages": [{"content": "a"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]},
     "messages[1].role"),
    ("chat", {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": CONTEXT},
     "max_completion_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat", {"messages": []}, "messages"),
    ("completions", {"prompt": "a", "priority": "high"}, "priority"),
    ("completions", {"prompt": "a", "priority": 1.5}, "priority"),
    ("completions", {"prompt": "a", "priority": True}, "priority"),
    ("chat", {"messages": [{"role": "user", "content": "a"}], "priority": 1 << 31}, "priority"),
    ("chat", {"messages": [{"role": "user", "content": "a"}], "priority": -(1 << 31) - 1}, "priority"),
])
def test_bad_parameters_are_400_naming_the_parameter_without_touching_the_router(fake, tiny_llama, endpoint,
                                                                               body, param):
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"

    async def scenario(client, gw):
        return await client.post(path, json=body)

    r = run(fake, tiny_llama, scenario)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert fake.calls == 0


def test_body_that_is_not_json_is_400(fake, tiny_llama):
    async def scenario(client, gw):
        return await client.post("/v1/completions", content=b"{nope")

    r = run(fake, tiny_llama, scenario)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize("code, param, status", [
    (grpc.StatusCode.INVALID_ARGUMENT, "max_tokens", 400),
    (grpc.StatusCode.NOT_FOUND, None, 404),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, None, 429),
    (grpc.StatusCode.UNAVAILABLE, None, 503),
    (grpc.StatusCode.INTERNAL, None, 500),
])
@pytest.mark.parametrize("stream", [False, True])
def test_router_errors_keep_their_http_status_and_message(tiny_llama, code, param, status, stream):
    with FakeRouter(failing(code, "the router says no", param), models=MODELS) as fake:
        async def scenario(client, gw):
            return await client.post("/v1/completions", json={"prompt": "a", "stream": stream})

        r = run(fake, tiny_llama, scenario)
    assert r.status_code == status
    err = r.json()["error"]
    assert "the router says no" in err["message"] and err["param"] == param


def test_error_after_the_first_token_is_reported_in_band(tiny_llama):
    def handler(req, context):
        yield from list(tokens(req, context))[:2]
        context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker died")

    with FakeRouter(handler, models=MODELS) as fake:
        async def scenario(client, gw):
            return await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 5, "stream": True})

        r = run(fake, tiny_llama, scenario)
    events = sse_events(r.text)
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "decode worker died" and events[-2]["error"]["code"] == "unavailable"


def test_unknown_model_is_404_and_no_workers_is_503(tiny_llama):
    async def scenario(client, gw):
        return (await client.post("/v1/completions", json={"prompt": "a", "model": "gpt-9"}),
                await client.get("/v1/models"))

    with FakeRouter(models=MODELS) as fake:
        missing, models = run(fake, tiny_llama, scenario)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert [m["id"] for m in models.json()["data"]] == [MODEL]
    assert models.json()["data"][0]["max_model_len"] == CONTEXT
    with FakeRouter(models=()) as empty:
        none, _ = run(empty, tiny_llama, scenario)
        assert empty.calls == 0
    assert none.status_code == 503 and "no workers" in none.json()["error"]["message"]


def test_wrong_method_and_unknown_path_are_openai_client_errors(fake, tiny_llama):
    async def scenario(client, gw):
        return (await client.get("/v1/chat/completions"), await client.post("/v1/models"),
                await client.post("/v1/nope", json={}))

    wrong, wrong_models, unknown = run(fake, tiny_llama, scenario)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"] == {"message": "GET is not allowed on /v1/chat/completions; use POST",
                                     "type": "invalid_request_error", "param": None, "code": "method_not_allowed"}
    assert wrong_models.status_code == 405 and wrong_models.json()["error"]["type"] == "invalid_request_error"
    assert unknown.status_code == 404
    assert unknown.json()["error"] == {"message": "Invalid URL (POST /v1/nope): no such endpoint",
                                       "type": "invalid_request_error", "param": None, "code": "unknown_url"}
    assert fake.calls == 0


def test_api_key_is_required_on_the_api_but_not_on_health_and_metrics(fake, tiny_llama):
    async def scenario(client, gw):
        body = {"prompt": "a", "max_tokens": 1}
        return (await client.post("/v1/completions", json=body),
                await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}),
                await client.get("/v1/models", headers={"Authorization": "Bearer wrong"}),
                await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-1"}),
                await client.get("/metrics"))

    none, wrong, models, right, metrics = run(fake, tiny_llama, scenario, api_key="sk-1")
    assert none.status_code == wrong.status_code == models.status_code == 401
    assert wrong.json()["error"]["type"] == "authentication_error"
    assert right.status_code == 200 and fake.calls == 1
    assert metrics.status_code == 200 and 'tandem_gateway_requests_total{endpoint="completions",status="401"} 2.0' \
        in metrics.text


def test_full_gateway_answers_429_at_once(fake, tiny_llama):
    async def scenario(client, gw):
        gw.inflight = gw.config.max_inflight
        return await client.post("/v1/completions", json={"prompt": "a"})

    r = run(fake, tiny_llama, scenario, max_inflight=2)
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error" and fake.calls == 0


async def _call_until_disconnect(app, path: str, body: dict, disconnect_after_body_chunks: int) -> list[dict]:
    """Drive the ASGI app directly; the client 'disconnects' after receiving some body chunks."""
    gone = asyncio.Event()
    sent: list[dict] = []
    request = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        if request:
            return request.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if sum(m["type"] == "http.response.body" for m in sent) >= disconnect_after_body_chunks:
            gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    task = asyncio.ensure_future(app(scope, receive, send))
    if disconnect_after_body_chunks == 0:
        await asyncio.sleep(0.3)
        gone.set()
    await asyncio.wait_for(task, 10)
    return sent


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_generation(tiny_llama, stream):
    from tandem.services.gateway.app import create_app

    with FakeRouter(lambda req, ctx: tokens(req, ctx, delay_s=0.05), models=MODELS) as fake:
        async def scenario(client, gw):
            body = {"prompt": "a", "max_tokens": 40, "stream": stream}
            await _call_until_disconnect(create_app(gw), "/v1/completions", body, 2 if stream else 0)
            return gw.inflight, gw.metrics.render().decode()

        inflight, metrics = run(fake, tiny_llama, scenario)
        assert fake.wait_cancelled(1), "the router call was not cancelled"
    assert inflight == 0
    assert 'tandem_gateway_requests_total{endpoint="completions",status="499"} 1.0' in metrics
