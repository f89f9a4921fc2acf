"""Tool-call formats (`--tool-call-parser`): each model family's calls read from whole answers and from
real token streams (the text a detokenizer hands over token by token), the two always agreeing."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from tokenizers import Tokenizer

from tandem.services.gateway.tool_formats import TOOL_PARSERS, create_tool_parser, parse_whole

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "zip": {"type": "string"}}}}}]
PARIS = {"city": "Paris", "days": 3}

# (format, model output, content, [(name, arguments)])
CASES = [
    ("hermes", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>', "Checking.", [("get_weather", PARIS)]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
     "", [("get_weather", PARIS)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
     "", [("get_weather", PARIS), ("get_weather", {"city": "Oslo"})]),
    ("llama3_json", "The weather in {city} is fine.", "The weather in {city} is fine.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),          # JSON, but not a call: content
    ("mistral", 'Let me look. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
     "Let me look.", [("get_weather", PARIS), ("get_weather", {"city": "Oslo"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_weather[ARGS]'
                '{"city": "Oslo"}', "", [("get_weather", PARIS), ("get_weather", {"city": "Oslo"})]),
    ("mistral", "No [TOOL_CALLS here, and [TOOL_CALLS] nothing after.", "No [TOOL_CALLS here, and [TOOL_CALLS]"
                " nothing after.", []),
    ("qwen3_coder", "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
     "I will check.", [("get_weather", PARIS)]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
                    "<parameter=metric>\ntrue\n</parameter>\n<parameter=zip>\n10001\n</parameter>\n</function>\n"
                    "</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
                    "</function>\n</tool_call>",
     "", [("get_weather", {"city": "New York", "metric": True, "zip": "10001"}), ("get_weather", {"city": "Rome"})]),
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _stream(name: str, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    """Feed `pieces` one by one; the content and calls the deltas add up to (as a client sees them)."""
    p = create_tool_parser(name, TOOLS)
    content, calls = "", {}
    for delta in [p.feed(x) for x in pieces] + [p.finish()]:
        content += delta.content
        for c in delta.calls:
            first = c["index"] not in calls            # a call's first delta, and only it, carries id and name
            assert ("id" in c) == first == ("name" in c["function"]), c
            entry = calls.setdefault(c["index"], {"name": "", "arguments": ""})
            entry["name"] += c["function"].get("name", "")
            entry["arguments"] += c["function"].get("arguments", "")
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path) -> Tokenizer:
    return Tokenizer.from_file(str(smollm2_path / "tokenizer.json"))


def _token_stream(tok: Tokenizer, text: str) -> list[str]:
    """The text a detokenizer emits token by token (each token's new text, held while it is incomplete)."""
    ids = tok.encode(text, add_special_tokens=False).ids
    pieces, sent = [], ""
    for i in range(1, len(ids) + 1):
        now = tok.decode(ids[:i], skip_special_tokens=False)
        if now.endswith("\ufffd"):
            continue
        pieces.append(now[len(sent):])
        sent = now
    assert sent == text
    return pieces


@pytest.mark.parametrize("name, text, content, calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_whole_and_streamed_answers_agree(tokenizer, name, text, content, calls):
    assert (lambda c, k: (c, _calls(k)))(*parse_whole(name, text, TOOLS)) == (content, calls)
    assert _stream(name, _token_stream(tokenizer, text)) == (content, calls)
    rng = random.Random(len(text))
    for _ in range(20):              # any other cut of the text: the same answer
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _stream(name, pieces) == (content, calls), pieces


def test_content_streams_before_the_calls_and_nothing_of_a_marker_leaks():
    p = create_tool_parser("mistral", TOOLS)
    assert p.feed("Let me look. [TOOL_").content == "Let me look."
    d = p.feed('CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    assert d.content == "" and d.calls[0]["id"].startswith("call_") and d.calls[0]["function"]["name"] == "get_weather"
    assert not p.finish()


def test_a_call_cut_short_stays_content_when_nothing_parsed():
    for name, text in [("mistral", '[TOOL_CALLS][{"name": "get_weather", "argu'),
                       ("llama3_json", '{"name": "get_weather", "parameters": {"ci'),
                       ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")]:
        content, calls = parse_whole(name, text, TOOLS)
        assert calls == [] and content == text, name


def test_every_parser_has_vllms_name():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "qwen3_coder"}


# ---- through the app: --tool-call-parser picks the format `auto` calls are read in ----------------------

MISTRAL_ANSWER = 'Let me look. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'


def _post(parser: str, answer: str, body: dict, folder) -> list:
    from tests.sdk.fake_router import FakeRouter
    from tests.services.gateway.conftest import MODEL, gateway_client, sse_events
    from tests.services.gateway.test_tools import MODELS, _answer

    async def go():
        with FakeRouter(lambda req, ctx: _answer(req, answer), models=MODELS) as fake:
            async with gateway_client(fake.addr, str(folder), tool_call_parser=parser) as (client, _gw):
                out = []
                for stream in (False, True):
                    r = await client.post("/v1/chat/completions", json={
                        "model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Weather?"}],
                        "tools": TOOLS, "stream": stream, **body})
                    assert r.status_code == 200, r.text
                    out.append(sse_events(r.text) if stream else r.json())
                return out, fake.requests

    return asyncio.run(go())


def test_the_configured_parser_reads_auto_calls_whole_and_streamed(tiny_llama):
    (whole, events), _ = _post("mistral", MISTRAL_ANSWER, {}, tiny_llama)
    msg = whole["choices"][0]["message"]
    assert msg["content"] == "Let me look." and whole["choices"][0]["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        [("get_weather", PARIS)]
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me look."
    streamed = [t for d in deltas for t in d.get("tool_calls", [])]
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in streamed] == [("get_weather", PARIS)]
    # The same answer read as Hermes (the default) is only text.
    (plain, _), _ = _post("hermes", MISTRAL_ANSWER, {}, tiny_llama)
    assert plain["choices"][0]["message"]["content"] == MISTRAL_ANSWER


def test_a_required_call_is_read_in_the_grammars_hermes_framing_whatever_the_parser(tiny_llama):
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    (whole, _), requests = _post("qwen3_coder", hermes, {"tool_choice": "required"}, tiny_llama)
    assert requests[0].sampling.structured.tool_calls.begin.startswith("<tool_call>")
    calls = whole["choices"][0]["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("get_weather", PARIS)]


def test_an_unknown_parser_is_refused():
    from tandem.services.gateway.config import GatewayConfig

    with pytest.raises(ValueError, match="--tool-call-parser must be one of hermes"):
        GatewayConfig(tool_call_parser="pythonic").validate()
