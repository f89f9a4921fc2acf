"""Output blocks (reasoning, text, tool calls) for the Responses and Messages APIs: streamed events
reassemble to the whole output's blocks however the text is cut."""

from __future__ import annotations

import functools
import random

import pytest

from tandem.services.gateway.blocks import OutputBlocks, whole
from tandem.services.gateway.tool_formats import create_tool_parser

HERMES = functools.partial(create_tool_parser, "hermes")
CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')


def summary(blocks) -> list[tuple]:
    return [(b.kind, b.text, b.name) for b in blocks]


@pytest.mark.parametrize(("text", "reasoning", "tools", "expected"), [
    ("plain answer", None, None, [("text", "plain answer", "")]),
    ("<think>hmm</think>\n\nyes", "qwen3", None, [("reasoning", "hmm", ""), ("text", "yes", "")]),
    ("<think>which tool?</think>Let me look.\n" + CALLS, "qwen3", HERMES,
     [("reasoning", "which tool?", ""), ("text", "Let me look.", ""),
      ("tool_call", '{"city": "Paris"}', "get_weather"), ("tool_call", "{}", "now")]),
    (CALLS, None, HERMES, [("tool_call", '{"city": "Paris"}', "get_weather"), ("tool_call", "{}", "now")]),
    (CALLS, None, None, [("text", CALLS, "")]),           # tools not offered: a call is just text
    ("", None, None, []),
])
def test_whole_output_blocks(text, reasoning, tools, expected):
    assert summary(whole(text, reasoning, tools).blocks) == expected


@pytest.mark.parametrize("seed", range(6))
def test_streamed_events_rebuild_the_whole_blocks_with_balanced_open_and_close(seed):
    text = "<think>which tool?</think>Let me look.\n" + CALLS
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), 12))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream = OutputBlocks("qwen3", tools=HERMES)
    events = [e for p in pieces for e in stream.feed(p)] + stream.finish()
    rebuilt: dict[int, list] = {}
    open_now = None
    for e in events:
        if e.what == "open":
            assert open_now is None and e.index == len(rebuilt)   # one block at a time, in order
            rebuilt[e.index] = [e.block.kind, "", e.block.name]
            open_now = e.index
        elif e.what == "delta":
            assert e.index == open_now
            rebuilt[e.index][1] += e.delta
        else:
            assert e.index == open_now
            open_now = None
    assert open_now is None
    assert [tuple(v) for v in rebuilt.values()] == summary(whole(text, "qwen3", HERMES).blocks)


def test_tool_call_arguments_as_an_object():
    calls = whole(CALLS, None, HERMES).blocks
    assert [b.arguments() for b in calls] == [{"city": "Paris"}, {}]
    assert all(b.call_id.startswith("call_") for b in calls) and calls[0].call_id != calls[1].call_id
