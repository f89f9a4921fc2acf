"""Output constraints of a generation (`SamplingParams.structured`), and reading tool calls back.

    from tandem_client import Client, JsonSchema, Choice, Tool, ToolCalls, parse_tool_calls

    client.generate(prompt, structured=JsonSchema.of(MyPydanticModel), max_tokens=200)
    client.generate(prompt, structured=Choice(["yes", "no"]))
    r = client.generate(prompt_offering_tools, structured=ToolCalls([Tool("get_weather", schema)]))
    calls = parse_tool_calls(r.text)      # [ToolCall(name="get_weather", arguments={...})]

One constraint per request. The server checks it (a schema it cannot enforce, a grammar that does not
compile: InvalidRequestError naming `structured...`). `Grammar` takes the server's grammar dialect
(Lark, or GBNF with `::=`; see the server's docs/structured-output.md). A generation the grammar left
without a legal token ends with FinishReason.GRAMMAR_DEAD_END: its text is not a complete value.

The SDK sends prompts, not chats: with `ToolCalls` the prompt must describe the tools and the call
format itself (the HTTP gateway's chat endpoint does both for you).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# The Hermes-style format the gateway uses for models whose chat template has no tool format of its own.
CALL_BEGIN, CALL_END, CALL_SEPARATOR = "<tool_call>\n", "\n</tool_call>", "\n"


@dataclass(frozen=True)
class JsonSchema:
    """The output is JSON matching `schema` (an object, or its JSON text). `strict`: a keyword the
    server cannot enforce is an error instead of being ignored."""

    schema: Mapping[str, Any] | str
    strict: bool = False

    @classmethod
    def of(cls, model: Any, strict: bool = False) -> JsonSchema:
        """The schema of a pydantic model class (anything with `model_json_schema()`)."""
        return cls(model.model_json_schema(), strict)

    @property
    def text(self) -> str:
        return self.schema if isinstance(self.schema, str) else json.dumps(self.schema)


@dataclass(frozen=True)
class JsonObject:
    """The output is a JSON object (OpenAI's response_format json_object)."""


@dataclass(frozen=True)
class Regex:
    """The whole output matches `pattern`."""

    pattern: str


@dataclass(frozen=True)
class Choice:
    """The output is exactly one of `options`."""

    options: Sequence[str]


@dataclass(frozen=True)
class Grammar:
    """The output is a sentence of `grammar` (the server's dialect: Lark, or GBNF)."""

    grammar: str


@dataclass(frozen=True)
class Tool:
    """A function the model may call; `parameters` is the JSON Schema of its arguments."""

    name: str
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def call_schema(self) -> str:
        return json.dumps({"type": "object", "properties": {"name": {"const": self.name}, "arguments": self.parameters},
                           "required": ["name", "arguments"]})


@dataclass(frozen=True)
class ToolCalls:
    """`min_calls`..`max_calls` calls (max 0: no limit) of `tools`, each `begin` + {"name", "arguments"}
    + `end`, `separator` between them; the defaults are the Hermes format `parse_tool_calls` reads."""

    tools: Sequence[Tool]
    min_calls: int = 1
    max_calls: int = 0
    begin: str = CALL_BEGIN
    end: str = CALL_END
    separator: str = CALL_SEPARATOR


Structured = JsonSchema | JsonObject | Regex | Choice | Grammar | ToolCalls


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The Hermes-format calls in a generation's text (blocks that are not a JSON call are skipped)."""
    calls = []
    for body in _CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("arguments", {})
            calls.append(ToolCall(obj["name"], json.loads(args) if isinstance(args, str) else args))
    return calls
