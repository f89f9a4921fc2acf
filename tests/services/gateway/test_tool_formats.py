"""Tool-call formats (`--tool-call-parser`): each model family's calls read from whole answers and from
real token streams (the text a detokenizer hands over token by token), the two always agreeing."""

from __future__ import annotations

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
