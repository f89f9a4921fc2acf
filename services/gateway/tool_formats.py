"""Tool-call output formats beside Hermes (`--tool-call-parser`, vLLM's names), and the registry the
gateway picks a parser from. Torch-free.

What each model family writes (the text after its chat template's generation prompt):
- `hermes` (tool_parser.py): `<tool_call>{"name": .., "arguments": {..}}</tool_call>`, any number,
  content around them.
- `llama3_json`: the whole answer is the calls: `{"name": .., "parameters": {..}}` objects (or
  "arguments"), separated by `;`, optionally after `<|python_tag|>`. An answer that does not start
  with one (after whitespace) is content; one that starts like a call but does not parse is content too.
- `mistral`: content, then `[TOOL_CALLS]` and either a JSON array of `{"name", "arguments"}` objects
  (tokenizers before v11) or `name[ARGS]{..}` (v11 and later; each call after its own `[TOOL_CALLS]`).
- `qwen3_coder`: content, then `<tool_call><function=NAME><parameter=P>VALUE</parameter>...
  </function></tool_call>` blocks (newlines around each tag). A value is raw text; it is read as JSON
  where the tool's schema gives the parameter a non-string type (and it parses), else kept a string.

These three stream content as it comes (holding back what may begin a call) and each call whole, once
its text is complete: the first delta of a call carries its id, name and all its arguments. As with
Hermes, a whole response is one `feed` and a `finish`, so a stream reassembles to the same answer.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any

from tandem.services.gateway.tool_parser import Delta, ToolCall, ToolCallParser, _hold, call_id, read_whole
from tandem.services.gateway.tools import ToolUse

_DECODER = json.JSONDecoder()
Calls = list[tuple[str, str]]      # (name, arguments as JSON text)


class _SectionParser:
    """Content until the calls section begins (`_locate`); the section is handed to `_take` as it grows."""

    marker = ""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.calls: list[ToolCall] = []
        self._tools = {t["function"]["name"]: t["function"] for t in tools or () if "function" in t}
        self._text = ""                    # content not yet emitted
        self._opening = ""                 # the whitespace before the section and the text that opened it
                                           # (content again if no call parses)
        self._section: str | None = None   # text of the section not yet turned into calls

    def feed(self, text: str) -> Delta:
        out = Delta()
        if self._section is None:
            self._text += text
            span = self._locate(self._text)
            if span is None:
                safe = self._text[:len(self._text) - self._held(self._text)]
                emit = safe.rstrip()               # whitespace right before a call is not content
                out.content += emit
                self._text = self._text[len(emit):]
                return out
            end, start = span
            before = self._text[:end].rstrip()
            out.content += before
            self._opening, self._section, self._text = self._text[len(before):start], self._text[start:], ""
        else:
            self._section += text
        self._drain(out, final=False)
        return out

    def finish(self) -> Delta:
        out = Delta()
        if self._section is not None:
            self._drain(out, final=True)
            rest = self._section
            if rest.strip():                  # what never became a call stays content
                out.content += rest.strip() if self.calls else self._opening + rest
            self._section = ""
        else:
            out.content += self._text.rstrip() if self.calls else self._text
            self._text = ""
        return out

    def _locate(self, text: str) -> tuple[int, int] | None:
        """(end of the content, start of the section) once the section has begun in `text`, else None."""
        at = text.find(self.marker)
        return None if at < 0 else (at, at + len(self.marker))

    def _held(self, text: str) -> int:
        """Characters at the end of `text` that may begin the section: not content yet."""
        return _hold(text, self.marker)

    def _drain(self, out: Delta, final: bool) -> None:
        while self._section:
            taken = self._take(self._section, final)
            if taken is None:
                return
            calls, used = taken
            self._section = self._section[used:]
            for name, arguments in calls:
                call = ToolCall(call_id(), name, arguments)
                self.calls.append(call)
                out.calls.append({"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                  "function": {"name": name, "arguments": arguments}})

    def _take(self, section: str, final: bool) -> tuple[Calls, int] | None:
        """The complete calls at the start of `section` and the characters they used; None if none yet."""
        raise NotImplementedError


def _call_of(obj: Any) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a `{"name", "arguments"|"parameters"}` object, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _json_at(text: str, start: int) -> tuple[Any, int] | None:
    """The JSON value at `start` (after whitespace) and where it ends; None while it is incomplete."""
    i = start + len(text[start:]) - len(text[start:].lstrip())
    try:
        return _DECODER.raw_decode(text, i)
    except json.JSONDecodeError:
        return None


class Llama3JsonParser(_SectionParser):
    """The whole answer is `{"name": .., "parameters": {..}}` objects separated by `;` (optionally after
    `<|python_tag|>`); any other first character makes it content."""

    marker = "<|python_tag|>"

    def __init__(self, tools=None) -> None:
        super().__init__(tools)
        self._plain = False                # decided: the answer is content

    def _locate(self, text):
        if self._plain:
            return None
        body = text.lstrip()
        lead = len(text) - len(body)
        if body.startswith("{"):
            return lead, lead
        if body.startswith(self.marker):
            return lead, lead + len(self.marker)
        if body and not self.marker.startswith(body):
            self._plain = True
        return None

    def _held(self, text):
        return 0 if self._plain else len(text)

    def _take(self, section, final):
        rest = section.lstrip().lstrip(";").lstrip()
        found = _json_at(rest, 0) if rest else None
        call = _call_of(found[0]) if found else None
        if call is None:
            return None
        return [call], len(section) - len(rest) + found[1]


class MistralParser(_SectionParser):
    """`[TOOL_CALLS]` then a JSON array of calls, or `name[ARGS]{..}` per call."""

    marker = "[TOOL_CALLS]"
    _ARGS = "[ARGS]"

    def _take(self, section, final):
        rest = section.lstrip()
        if rest.startswith(self.marker):           # v11: every call after its own marker
            rest = rest[len(self.marker):].lstrip()
        skipped = len(section) - len(rest)
        if rest.startswith("["):
            found = _json_at(rest, 0)
            calls = [_call_of(o) for o in found[0]] if found and isinstance(found[0], list) else [None]
            if not calls or None in calls:
                return None
            return calls, skipped + found[1]
        at = rest.find(self._ARGS)
        found = _json_at(rest, at + len(self._ARGS)) if at > 0 else None
        if found is None or not isinstance(found[0], dict) or not rest[:at].strip():
            return None
        return [(rest[:at].strip(), json.dumps(found[0], ensure_ascii=False))], skipped + found[1]


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


class Qwen3CoderParser(_SectionParser):
    """`<tool_call><function=NAME><parameter=P>VALUE</parameter></function></tool_call>` blocks."""

    marker = "<tool_call>"
    _END = "</tool_call>"

    def _take(self, section, final):
        rest = section.lstrip()
        if rest.startswith(self.marker):
            rest = rest[len(self.marker):]
        skipped = len(section) - len(rest)
        end = rest.find(self._END)
        if end < 0:
            if not final:
                return None
            end = len(rest)                      # cut short: what arrived of the call, if it is whole
        m = _FUNCTION.search(rest[:end])
        if m is None:
            return None
        name = m.group(1).strip()
        args = {p.strip(): self._value(name, p.strip(), v) for p, v in _PARAMETER.findall(m.group(2))}
        used = end + len(self._END) if rest.startswith(self._END, end) else end
        return [(name, json.dumps(args, ensure_ascii=False))], skipped + used

    def _value(self, function: str, parameter: str, raw: str) -> Any:
        schema = self._tools.get(function, {}).get("parameters", {}).get("properties", {}).get(parameter, {})
        kind = schema.get("type") if isinstance(schema, dict) else None
        if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
            return raw
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw


TOOL_PARSERS: dict[str, Callable[[list[dict[str, Any]] | None], Any]] = {
    "hermes": lambda tools: ToolCallParser(),
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "qwen3_coder": Qwen3CoderParser,
}


def create_tool_parser(name: str, tools: list[dict[str, Any]] | None = None):
    """A fresh parser of format `name` (one of TOOL_PARSERS) for one response; `tools` are the request's
    OpenAI tool definitions (qwen3_coder reads parameter types from them)."""
    return TOOL_PARSERS[name](tools)


def parser_for(name: str, tools: ToolUse | None) -> Callable[[], Any] | None:
    """What makes each response's tool parser for a request: None when it offers no tools. A required or
    named call is written by the grammar in Hermes's framing (tools.CALL_FORMAT), so it is read back as
    hermes whatever `name` (--tool-call-parser) says, as vLLM reads those as its own JSON."""
    if tools is None or not tools.offered:
        return None
    fmt = "hermes" if tools.choice in ("required", "function") else name
    return functools.partial(create_tool_parser, fmt, [t.spec() for t in tools.tools])


def parse_whole(name: str, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ToolCall]]:
    """A whole output → (content, calls), with the parser `name`."""
    return read_whole(create_tool_parser(name, tools), text)
