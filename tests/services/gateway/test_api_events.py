"""The Responses and Messages APIs' bodies and stream events built from router chunks, with no server
and no model (a word-level tokenizer made here); and an error after the first event, in band."""

from __future__ import annotations

import asyncio
import functools
import json

import grpc
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from tandem.services.gateway.messages_api import MessagesFormat
from tandem.services.gateway.responses import Choice, usage
from tandem.services.gateway.responses_api import ResponsesFormat
from tandem.services.gateway.tokenizer import GatewayTokenizer
from tandem.services.gateway.tool_formats import create_tool_parser
from tandem.v1 import generation_pb2 as pb
from tests.sdk.fake_router import FakeRouter, tokens
from tests.services.gateway.conftest import MODEL, MODELS, gateway_client

HERMES = functools.partial(create_tool_parser, "hermes")

pytestmark = pytest.mark.timeout(60)
TEXT = '<think>two words</think>Checking.\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


def words() -> GatewayTokenizer:
    tok = Tokenizer(WordLevel({"[UNK]": 0, "two": 1, "words": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return GatewayTokenizer(tok, None, {})


def chunks(text: str, step: int = 4, reason: int = pb.FINISH_REASON_STOP) -> list[pb.GenerateResponse]:
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    out = [pb.GenerateResponse(text=p, token_ids=[5]) for p in pieces]
    out[-1].finish_reason = reason
    return out


def decode(frames: list[bytes]) -> list[tuple[str, dict]]:
    """(event name, payload) of each frame; the name must be the payload's type."""
    out = []
    for frame in frames:
        head, data = frame.decode().rstrip("\n").split("\n")
        name, payload = head.removeprefix("event: "), json.loads(data.removeprefix("data: "))
        assert payload["type"] == name
        out.append((name, payload))
    return out


def stream(fmt, msgs: list[pb.GenerateResponse]) -> tuple[list[tuple[str, dict]], Choice]:
    choice = Choice(0, 7)
    frames = fmt.start()
    for m in msgs:
        choice.track(m)
        frames += fmt.chunk(0, m, False)
    return decode(frames + fmt.end([choice], usage([choice], 1), False)), choice


def test_responses_stream_events_match_the_whole_response():
    head = {"id": "resp_1", "object": "response", "model": MODEL}
    events, _ = stream(ResponsesFormat(head, words(), "qwen3", HERMES), chunks(TEXT))
    assert [p["sequence_number"] for _, p in events] == list(range(len(events)))
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
    added = [p["output_index"] for n, p in events if n == "response.output_item.added"]
    done = [p for n, p in events if n == "response.output_item.done"]
    assert added == [d["output_index"] for d in done] == [0, 1, 2]
    final = events[-1][1]["response"]
    assert final["output"] == [d["item"] for d in done]          # what was streamed is what completed
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 2   # "two words"
    whole = Choice(0, 7)
    for m in chunks(TEXT):
        whole.add(m)
    body = ResponsesFormat(head, words(), "qwen3", HERMES).response([whole], 1)
    ids = ("id", "call_id")
    strip = [{k: v for k, v in o.items() if k not in ids} for o in body["output"]]
    assert strip == [{k: v for k, v in o.items() if k not in ids} for o in final["output"]]


def test_messages_stream_events_and_stop_reasons():
    events, _ = stream(MessagesFormat("msg_1", MODEL, 7, "qwen3", HERMES), chunks(TEXT))
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    starts = [p["content_block"]["type"] for n, p in events if n == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert [p["index"] for n, p in events if n == "content_block_stop"] == [0, 1, 2]
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    args = "".join(p["delta"]["partial_json"] for n, p in events
                   if n == "content_block_delta" and p["delta"]["type"] == "input_json_delta")
    assert json.loads(args) == {}
    cut, _ = stream(MessagesFormat("msg_2", MODEL, 7, None, None), chunks("abc", reason=pb.FINISH_REASON_LENGTH))
    assert cut[-2][1]["delta"]["stop_reason"] == "max_tokens"


def _sse(body: str) -> list[tuple[str, dict]]:
    return [(b.split("\n")[0].removeprefix("event: "), json.loads(b.split("\n")[1].removeprefix("data: ")))
            for b in body.strip().split("\n\n")]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/responses", {"input": "a", "max_output_tokens": 5, "stream": True}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 5, "stream": True}),
])
def test_an_error_after_the_first_token_is_an_error_event(tiny_llama, path, body):
    def handler(req, context):
        yield from list(tokens(req, context))[:2]
        context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker died")

    async def go():
        with FakeRouter(handler, models=MODELS) as fake:
            async with gateway_client(fake.addr, str(tiny_llama)) as (client, _gw):
                return await client.post(path, json={"model": MODEL, **body})

    r = asyncio.run(go())
    assert r.status_code == 200
    if path == "/v1/messages":
        name, payload = _sse(r.text)[-1]
        assert name == "error"
        assert payload == {"type": "error", "error": {"type": "overloaded_error", "message": "decode worker died"}}
    else:   # the error, then the response as it stood, failed
        error, failed = _sse(r.text)[-2:]
        assert error[0] == "error" and error[1]["code"] == "unavailable"
        assert failed[0] == "response.failed" and failed[1]["response"]["status"] == "failed"
        assert failed[1]["response"]["error"] == {"code": "unavailable", "message": "decode worker died"}
        (item,) = failed[1]["response"]["output"]
        assert item["content"][0]["text"] == "t0 t1 " and item["status"] == "incomplete"
