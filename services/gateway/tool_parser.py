"""Tool calling, the output side: the model's Hermes-format calls (`<tool_call>{"name", "arguments"}
</tool_call>`) turned into OpenAI `tool_calls`, text outside them kept as content. Torch-free.

One state machine serves streaming and whole responses: a whole response is one `feed` of all its
text and a `finish`, so a stream's deltas reassemble to exactly what the non-streaming answer holds.
While streaming, text that might be the start of `<tool_call>` is held back, a call's first delta
carries its id and name once `{"name": "..", "arguments":` has arrived, and the arguments object is
passed on as the model writes it (its raw JSON text, which is what `arguments` holds in the end).
Whitespace right before a call, between calls and after the last is not content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tandem.services.gateway.tools import CALL_BEGIN, CALL_END

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Delta:
    """What one `feed` adds: content text, and OpenAI stream entries for the calls it touched."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


def _arguments_text(obj: dict[str, Any]) -> str:
    args = obj.get("arguments", obj.get("parameters", {}))
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _hold(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class _Args:
    """Scans a JSON object or array as it arrives; `take` returns the part of it new since last time."""

    def __init__(self) -> None:
        self.streamable: bool | None = None   # None until the value's first character is seen
        self.done = False
        self.depth = 0
        self.in_string = self.escape = False
        self.pos = 0                          # how far into the text after the header we have read

    def take(self, text: str) -> str:
        start = None
        i = self.pos
        while i < len(text) and not self.done:
            ch = text[i]
            if self.streamable is None:
                if ch.isspace():
                    i += 1
                    continue
                self.streamable = ch in "{["
                if not self.streamable:
                    break
                start = i
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                self.done = self.depth == 0
            i += 1
        begin = self.pos if start is None else start
        self.pos = i
        return text[begin:i] if self.streamable else ""


class ToolCallParser:
    """feed(text) → Delta, …, finish() → Delta; `calls` holds every call seen, complete at the end."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._text = ""           # unemitted text outside calls
        self._in_call = False
        self._call = ""           # text of the call being read, after <tool_call>
        self._current: ToolCall | None = None
        self._header_end = 0
        self._args: _Args | None = None
        self._after_call = False  # whitespace right after a call is dropped, however it arrives

    def feed(self, text: str) -> Delta:
        out = Delta()
        if self._in_call:
            self._call += text
        else:
            self._text += text
        while True:
            if not self._in_call:
                if self._after_call:
                    self._text = self._text.lstrip()
                    self._after_call = not self._text
                at = self._text.find(CALL_BEGIN)
                if at < 0:
                    safe = self._text[:len(self._text) - _hold(self._text, CALL_BEGIN)]
                    emit = safe.rstrip()          # trailing whitespace waits: it may come right before a call
                    out.content += emit
                    self._text = self._text[len(emit):]
                    return out
                out.content += self._text[:at].rstrip()
                self._call, self._text, self._in_call = self._text[at + len(CALL_BEGIN):], "", True
            end = self._call.find(CALL_END)
            self._read_call(self._call if end < 0 else self._call[:end], out)
            if end < 0:
                return out
            self._close_call(self._call[:end], out, ended=True)
            self._text, self._call, self._in_call = self._call[end + len(CALL_END):], "", False

    def finish(self) -> Delta:
        out = Delta()
        if self._in_call:
            self._close_call(self._call, out, ended=False)
            self._in_call, self._call = False, ""
        out.content += self._text.rstrip() if self.calls else self._text
        self._text = ""
        return out

    # A call's header (`{"name": "..", "arguments":`) opens it in the stream; its arguments follow.
    def _read_call(self, body: str, out: Delta) -> None:
        if self._current is None:
            m = _HEADER.match(body)
            if m is None:
                return
            try:
                name = json.loads(f'"{m.group(1)}"')
            except json.JSONDecodeError:
                return
            self._open(name, out)
            self._header_end = m.end()
            self._args = _Args()
        if self._args is not None and not self._args.done:
            self._add_args(self._args.take(body[self._header_end:]), out)

    def _close_call(self, body: str, out: Delta, ended: bool) -> None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            obj = None
        valid = isinstance(obj, dict) and isinstance(obj.get("name"), str)
        if self._current is None:
            if valid:
                self._open(obj["name"], out)
                self._add_args(_arguments_text(obj), out)
                self._after_call = True
            else:  # not a call after all: the text stays content
                out.content += CALL_BEGIN + body + (CALL_END if ended else "")
        else:
            if valid and self._args is not None and not self._args.streamable:
                self._add_args(_arguments_text(obj), out)   # a non-object value: sent whole
            self._after_call = True
        self._current, self._args = None, None

    def _open(self, name: str, out: Delta) -> None:
        self._current = ToolCall(call_id(), name)
        self.calls.append(self._current)
        out.calls.append({"index": len(self.calls) - 1, "id": self._current.id, "type": "function",
                          "function": {"name": name, "arguments": ""}})

    def _add_args(self, text: str, out: Delta) -> None:
        if not text:
            return
        assert self._current is not None
        self._current.arguments += text
        index = len(self.calls) - 1
        if out.calls and out.calls[-1]["index"] == index:
            out.calls[-1]["function"]["arguments"] += text
        else:
            out.calls.append({"index": index, "function": {"arguments": text}})


def read_whole(parser, text: str) -> tuple[str, list[ToolCall]]:
    """A whole output → (content, calls), read by a fresh `parser` (any format's: one feed, a finish)."""
    content = parser.feed(text).content + parser.finish().content
    return content, parser.calls


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A whole Hermes-format output → (content, calls)."""
    return read_whole(ToolCallParser(), text)
