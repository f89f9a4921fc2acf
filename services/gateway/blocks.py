"""A model's output as typed blocks — reasoning, text, tool calls — for the APIs whose outputs are
lists of such parts (the Responses API's output items, the Messages API's content blocks).

One state machine for streaming and whole outputs, as the parsers it runs: the text goes through the
reasoning parser (reasoning.py, when `--reasoning-parser` is set), then its answer through the tool
call parser (tool_parser.py, when tools are offered). `feed` returns what changed as open / delta /
close events of numbered blocks, so an API writes its own stream events from them; a whole output is
one `feed` and a `finish`, so a stream reassembles to exactly the non-streaming blocks.
Within one feed, text comes before the calls it holds (a call's whitespace is not text).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from tandem.services.gateway.reasoning import ReasoningParser, Split

Kind = Literal["reasoning", "text", "tool_call"]


@dataclass
class Block:
    kind: Kind
    text: str = ""        # reasoning or text; a tool call's arguments (JSON text, as the model wrote it)
    call_id: str = ""
    name: str = ""

    def arguments(self) -> dict:
        """A tool call's arguments as an object ({} when the model wrote something that is not one)."""
        try:
            value = json.loads(self.text) if self.text.strip() else {}
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class BlockEvent:
    what: Literal["open", "delta", "close"]
    index: int
    block: Block
    delta: str = ""


class OutputBlocks:
    """feed(text) → events, …, finish() → events; `blocks` holds every block, complete at the end."""

    def __init__(self, reasoning: str | None, tools: Callable[[], Any] | None):
        """`tools`: makes the tool-call parser (tool_formats.parser_for); None: no tools offered."""
        self.blocks: list[Block] = []
        self._reasoning = ReasoningParser(reasoning) if reasoning else None
        self._tools = tools() if tools else None
        self._open = False

    @property
    def open(self) -> bool:
        """Whether the last block is still being written."""
        return self._open

    @property
    def called(self) -> bool:
        return any(b.kind == "tool_call" for b in self.blocks)

    def feed(self, text: str) -> list[BlockEvent]:
        split = self._reasoning.feed(text) if self._reasoning is not None else Split(content=text)
        return self._take(split, end=False)

    def finish(self) -> list[BlockEvent]:
        split = self._reasoning.finish() if self._reasoning is not None else Split()
        out = self._take(split, end=True)
        if self._open:
            out.append(BlockEvent("close", len(self.blocks) - 1, self.blocks[-1]))
            self._open = False
        return out

    def _take(self, split: Split, end: bool) -> list[BlockEvent]:
        out: list[BlockEvent] = []
        self._add(out, "reasoning", split.reasoning)
        if self._tools is None:
            self._add(out, "text", split.content)
            return out
        d = self._tools.feed(split.content)
        if end:
            last = self._tools.finish()
            d.content += last.content
            d.calls += last.calls
        self._add(out, "text", d.content)
        for entry in d.calls:
            fn = entry["function"]
            if "id" in entry:   # a call's first entry: a new block
                self._start(out, Block("tool_call", call_id=entry["id"], name=fn["name"]))
            self._add(out, "tool_call", fn.get("arguments", ""), new=False)
        return out

    def _start(self, out: list[BlockEvent], block: Block) -> None:
        if self._open:
            out.append(BlockEvent("close", len(self.blocks) - 1, self.blocks[-1]))
        self.blocks.append(block)
        self._open = True
        out.append(BlockEvent("open", len(self.blocks) - 1, block))

    def _add(self, out: list[BlockEvent], kind: Kind, text: str, new: bool = True) -> None:
        if not text:
            return
        if new and not (self._open and self.blocks[-1].kind == kind):
            self._start(out, Block(kind))
        block = self.blocks[-1]
        block.text += text
        out.append(BlockEvent("delta", len(self.blocks) - 1, block, text))


def whole(text: str, reasoning: str | None, tools: Callable[[], Any] | None) -> OutputBlocks:
    """A whole output's blocks."""
    blocks = OutputBlocks(reasoning, tools)
    blocks.feed(text)
    blocks.finish()
    return blocks
