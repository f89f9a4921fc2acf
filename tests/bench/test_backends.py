"""Client backends: SSE parsing and timing (mock HTTP transport), gRPC streaming (in-process server)."""

import asyncio
import json

import httpx
import pytest

from tandem.bench.serve.backends import BackendConfig, OpenAIHTTPBackend, TandemGrpcBackend, make_backend
from tandem.bench.serve.records import BenchRequest
from tests.bench.fakes import FakeServer

REQ = BenchRequest(prompt=" alpha bravo", prompt_len=2, output_len=3, prompt_ids=(11, 12))


def sse(*events) -> list[bytes]:
    return [f"data: {json.dumps(e) if not isinstance(e, str) else e}\n\n".encode() for e in events]


def completion(text, finish=None, usage=None):
    d = {"choices": [{"index": 0, "text": text, **({"finish_reason": finish} if finish else {})}]}
    if usage:
        d["usage"] = usage
    return d


def run_http(chunks: list[bytes], gap: float = 0.0, status: int = 200, cfg: BackendConfig | None = None,
             req: BenchRequest = REQ):
    seen = {}

    async def body():
        for c in chunks:
            if gap:
                await asyncio.sleep(gap)
            yield c

    async def handler(request: httpx.Request) -> httpx.Response:
        seen["url"] = str(request.url)
        seen["body"] = json.loads(request.content)
        if status != 200:
            return httpx.Response(status, json={"detail": "Unexpected fields in the request: {'ignore_eos'}"})
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    async def go():
        backend = OpenAIHTTPBackend(cfg or BackendConfig(base_url="http://server:1/", model="m"))
        backend._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        await backend.start()
        try:
            return await backend.send(req)
        finally:
            await backend.close()

    return asyncio.run(go()), seen


def test_completions_stream_timing_and_usage():
    chunks = sse(completion(" one"), completion(" two"), completion(""),  # a held-back token is still a token
                 completion("", finish="length", usage={"prompt_tokens": 2, "completion_tokens": 3}), "[DONE]")
    rec, seen = run_http(chunks, gap=0.02)
    assert seen["url"] == "http://server:1/v1/completions"
    assert seen["body"]["prompt"] == " alpha bravo" and seen["body"]["max_tokens"] == 3
    assert seen["body"]["stream"] is True and seen["body"]["stream_options"] == {"include_usage": True}
    assert seen["body"]["ignore_eos"] is True and seen["body"]["temperature"] == 0.0
    assert rec.success and rec.output_tokens == 3 and rec.output_text == " one two"
    assert len(rec.token_times) == 3                 # the finish-only chunk is not a token
    # The mock server sleeps 20 ms before each chunk, and the client pulls chunks one by one, so no
    # gap is shorter (5 ms of timer slack); the upper bound only catches a wrong clock (a busy 2-core
    # machine adds tens of ms: the ±15 ms bound once failed under CI load).
    assert 0.015 <= rec.ttft < 1.0
    assert len(rec.itl) == 2 and all(0.015 <= x < 1.0 for x in rec.itl)
    assert rec.e2e >= rec.token_times[-1] - rec.start


def test_without_usage_tokens_are_counted_events():
    rec, _ = run_http(sse(completion("a"), completion("b"), "[DONE]"))
    assert rec.success and rec.output_tokens == 2


def test_http_error_is_a_failed_record_with_the_message():
    rec, _ = run_http([], status=422)
    assert not rec.success and rec.error.startswith("HTTP 422") and "ignore_eos" in rec.error


def test_error_event_in_stream_and_empty_stream():
    rec, _ = run_http(sse(completion("a"), {"error": {"message": "engine died"}}))
    assert not rec.success and rec.error == "engine died"
    rec, _ = run_http(sse("[DONE]"))
    assert not rec.success and "without any output" in rec.error


def test_unreachable_server_is_a_failed_record():
    async def go():
        backend = OpenAIHTTPBackend(BackendConfig(base_url="http://127.0.0.1:9", timeout_s=5))
        await backend.start()
        try:
            return await backend.send(REQ)
        finally:
            await backend.close()
    rec = asyncio.run(go())
    assert not rec.success and "Connect" in rec.error


@pytest.mark.parametrize("mode,expected", [
    ("ignore-eos", {"ignore_eos": True}),
    ("min-tokens", {"min_tokens": 3}),
    ("hf-generation-config", {"generation_config": '{"min_new_tokens": 3}'}),
    ("off", {}),
])
def test_force_output_len_modes(mode, expected):
    body = OpenAIHTTPBackend(BackendConfig(base_url="http://x", force_output_len=mode, extra_body={"top_k": 1})).body(REQ)
    for key in ("ignore_eos", "min_tokens", "generation_config"):
        assert body.get(key) == expected.get(key)
    assert body["top_k"] == 1


def test_priority_is_sent_only_when_the_workload_sets_one():
    backend = OpenAIHTTPBackend(BackendConfig(base_url="http://x"))
    assert "priority" not in backend.body(REQ)
    assert backend.body(BenchRequest(prompt="a", prompt_len=1, output_len=1, priority=-3))["priority"] == -3
    rec, seen = run_http(sse(completion("a"), "[DONE]"), req=BenchRequest(prompt="a", prompt_len=1, output_len=1,
                                                                            priority=7))
    assert seen["body"]["priority"] == 7 and rec.priority == 7
    grpc_backend = TandemGrpcBackend(BackendConfig(base_url="127.0.0.1:1"))
    assert grpc_backend.request(BenchRequest(prompt="a", prompt_len=1, output_len=1, priority=5)).priority == 5
    assert grpc_backend.request(REQ).priority == 0


def test_a_requests_model_overrides_the_backends():
    # A multi-LoRA workload names an adapter per request (bench/lora_routing.py).
    cfg = BackendConfig(base_url="http://x", model="base")
    sql = BenchRequest(prompt="a", prompt_len=1, output_len=1, model="sql")
    assert OpenAIHTTPBackend(cfg).body(sql)["model"] == "sql" and OpenAIHTTPBackend(cfg).body(REQ)["model"] == "base"
    grpc_backend = TandemGrpcBackend(BackendConfig(base_url="127.0.0.1:1", model="base"))
    assert grpc_backend.request(sql).model == "sql" and grpc_backend.request(REQ).model == "base"


def test_chat_endpoint():
    chunks = sse({"choices": [{"delta": {"role": "assistant"}}]}, {"choices": [{"delta": {"content": "hi"}}]},
                 {"choices": [{"delta": {"content": " there"}}]}, {"choices": [{"delta": {}, "finish_reason": "length"}]},
                 "[DONE]")
    rec, seen = run_http(chunks, cfg=BackendConfig(base_url="http://s", endpoint="/v1/chat/completions"))
    assert seen["body"]["messages"] == [{"role": "user", "content": " alpha bravo"}]
    assert rec.success and len(rec.token_times) == 2 and rec.output_tokens == 2 and rec.output_text == "hi there"


def test_chat_endpoint_sends_a_requests_history_and_completions_its_prompt():
    history = BenchRequest(prompt="q1 a1 q2", prompt_len=3, output_len=1,
                           messages=(("user", "q1"), ("assistant", " a1"), ("user", " q2")))
    chat = OpenAIHTTPBackend(BackendConfig(base_url="http://x", endpoint="/v1/chat/completions")).body(history)
    assert chat["messages"] == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": " a1"},
                                {"role": "user", "content": " q2"}]
    plain = OpenAIHTTPBackend(BackendConfig(base_url="http://x")).body(history)
    assert plain["prompt"] == "q1 a1 q2" and "messages" not in plain


def test_tandem_grpc_backend_streams_and_maps_errors():
    async def go(port):
        backend = make_backend("tandem-grpc", BackendConfig(base_url=f"grpc://127.0.0.1:{port}", temperature=0.5))
        await backend.start()
        try:
            ok = await backend.send(REQ)
            text = await backend.send(BenchRequest(prompt="hello", prompt_len=1, output_len=2))
            bad = await backend.send(BenchRequest(prompt="bad", prompt_len=1, output_len=2))
            return ok, text, bad
        finally:
            await backend.close()

    with FakeServer() as fake:
        servicer = fake.servicer
        ok, text, bad = asyncio.run(go(fake.port))
    sent = servicer.requests[0]
    assert list(sent.token_ids.ids) == [11, 12] and sent.sampling.ignore_eos
    assert sent.sampling.max_tokens == 3 and sent.sampling.temperature == pytest.approx(0.5)
    assert servicer.requests[1].text == "hello"
    assert ok.success and ok.output_tokens == 3 and len(ok.itl) == 2 and ok.output_text == " t0 t1 t2"
    # The fake waits 10 ms before its first chunk; the upper bound only catches a wrong clock (a busy
    # 2-core machine adds tens of ms).
    assert 0.01 <= ok.ttft < 1.0
    assert text.success and text.output_tokens == 2
    assert not bad.success and bad.error == "INVALID_ARGUMENT: prompt is bad"


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend"):
        make_backend("carrier-pigeon", BackendConfig(base_url="x"))
    assert isinstance(make_backend("openai-http", BackendConfig(base_url="x")), OpenAIHTTPBackend)
    assert isinstance(make_backend("tandem-grpc", BackendConfig(base_url="x")), TandemGrpcBackend)
