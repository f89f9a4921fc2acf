"""--reasoning-parser: a thinking model's reasoning split from its answer (`reasoning_content`), whole and
streamed (the deltas reassemble to the whole answer however the text is cut), tool calls read from the
answer only, and nothing of the reasoning in a JSON answer."""

from __future__ import annotations

import asyncio
import json

import pytest

from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.reasoning import ReasoningParser, split_reasoning
from tandem.v1 import generation_pb2 as pb
from tests.sdk.fake_router import FakeRouter
from tests.services.gateway.conftest import MODEL, gateway_client, sse_events
from tests.services.gateway.test_tools import MODELS, TOOLS, _answer

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'

# (parser, output, reasoning, answer)
CASES = [
    ("qwen3", "<think>\nThe user wants Paris.\n</think>\n\nParis is the capital.", "\nThe user wants Paris.\n",
     "Paris is the capital."),
    ("qwen3", "No thinking here.", "", "No thinking here."),
    ("qwen3", "<think>cut short while thi", "cut short while thi", ""),
    ("qwen3", "a <thin b", "", "a <thin b"),
    ("deepseek_r1", "Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    ("deepseek_r1", "<think>\nHmm.\n</think>\n\n4", "\nHmm.\n", "4"),
    ("deepseek_r1", "still thinking when the tokens ran out", "still thinking when the tokens ran out", ""),
    ("deepseek_r1", "x < y so</think>yes", "x < y so", "yes"),
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "answer"), CASES)
def test_whole_and_streamed_splits_agree_however_the_text_is_cut(parser, text, reasoning, answer):
    whole = split_reasoning(parser, text)
    assert (whole.reasoning, whole.content) == (reasoning, answer)
    for step in (1, 2, 3, 5, 7):
        p = ReasoningParser(parser)
        got_r = got_c = ""
        for i in range(0, len(text), step):
            d = p.feed(text[i:i + step])
            got_r, got_c = got_r + d.reasoning, got_c + d.content
            assert "<think" not in got_r + got_c and "</thi" not in got_r + got_c   # tags never leak out
        end = p.finish()
        assert (got_r + end.reasoning, got_c + end.content) == (reasoning, answer), step


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser("nope")
    with pytest.raises(ValueError, match="--reasoning-parser"):
        GatewayConfig(reasoning_parser="nope").validate()


def _post(text: str, body: dict, parser: str | None = "qwen3", tokenizer=None):
    async def go():
        with FakeRouter(lambda req, ctx: _answer(req, text), models=MODELS) as fake:
            async with gateway_client(fake.addr, str(tokenizer), reasoning_parser=parser) as (client, _gw):
                return await client.post("/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Weather?"}], **body})

    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    return r


def test_chat_returns_reasoning_content_and_its_stream_reassembles(tiny_llama):
    text = "<think>\nThey ask about Paris.\n</think>\n\nIt is sunny in Paris."
    msg = _post(text, {}, tokenizer=tiny_llama).json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "It is sunny in Paris.",
                   "reasoning_content": "\nThey ask about Paris.\n"}
    events = sse_events(_post(text, {"stream": True}, tokenizer=tiny_llama).text)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    assert deltas[0]["role"] == "assistant"
    plain = _post(text, {}, parser=None, tokenizer=tiny_llama).json()["choices"][0]["message"]
    assert plain == {"role": "assistant", "content": text}           # no parser: untouched


def test_tool_calls_are_read_from_the_answer_only(tiny_llama):
    thinking_call = f"<think>\nMaybe {CALL} but no.\n</think>\n\n{CALL}"
    r = _post(thinking_call, {"tools": TOOLS}, tokenizer=tiny_llama).json()["choices"][0]
    assert r["finish_reason"] == "tool_calls"
    assert [json.loads(c["function"]["arguments"]) for c in r["message"]["tool_calls"]] == [{"city": "Paris", "unit": "c"}]
    assert CALL in r["message"]["reasoning_content"]                 # the call it only thought of stays thought
    events = sse_events(_post(thinking_call, {"tools": TOOLS, "stream": True}, tokenizer=tiny_llama).text)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == r["message"]["reasoning_content"]
    assert sum(len(d.get("tool_calls", [])) for d in deltas) >= 1


def test_a_json_answer_carries_no_reasoning(tiny_llama):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    text = '<think>Paris, clearly.</think>{"city": "Paris"}'
    msg = _post(text, {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}},
                tokenizer=tiny_llama).json()["choices"][0]["message"]
    assert json.loads(msg["content"]) == {"city": "Paris"} and msg["reasoning_content"] == "Paris, clearly."


def test_the_finish_reason_survives_a_stream_that_ends_in_reasoning(tiny_llama):
    async def go():
        def handler(req, ctx):
            yield from _answer(req, "<think>out of tokens", pb.FINISH_REASON_LENGTH)

        with FakeRouter(handler, models=MODELS) as fake:
            async with gateway_client(fake.addr, str(tiny_llama), reasoning_parser="qwen3") as (client, _gw):
                return await client.post("/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "?"}]})

    events = sse_events(asyncio.run(go()).text)
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "length"
    assert "".join(e["choices"][0]["delta"].get("reasoning_content", "") for e in events[:-1]) == "out of tokens"


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1", None])
def test_a_constraint_holds_after_the_thinking(tiny_llama, parser):
    """With a reasoning parser the gateway asks for the constraint after the model's thinking (the
    worker's grammar then lets it think first: tests/engine/structured/test_matcher.py); without one,
    from the first token. Chat completions, Responses and Messages alike."""
    seen: list[pb.GenerateRequest] = []

    def handler(req, ctx):
        seen.append(req)
        yield from _answer(req, '{"city": "Paris"}')

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    bodies = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "?"}], "max_tokens": 32,
                                 "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}},
        "/v1/responses": {"input": "?", "max_output_tokens": 32,
                          "text": {"format": {"type": "json_schema", "name": "c", "schema": schema}}},
        "/v1/messages": {"messages": [{"role": "user", "content": "?"}], "max_tokens": 32,
                         "output_config": {"format": {"type": "json_schema", "schema": schema}}},
    }

    async def go():
        with FakeRouter(handler, models=MODELS) as fake:
            async with gateway_client(fake.addr, str(tiny_llama), reasoning_parser=parser) as (client, _gw):
                return [await client.post(path, json={"model": MODEL, **body}) for path, body in bodies.items()]

    for r in asyncio.run(go()):
        assert r.status_code == 200, r.text
    assert [req.sampling.structured.reasoning for req in seen] == [parser or ""] * 3
    assert all(json.loads(req.sampling.structured.json_schema)["required"] == ["city"] for req in seen)
