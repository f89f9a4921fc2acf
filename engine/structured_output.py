"""What a request's output must match (torch-free): the engine's mirror of the public API's
`StructuredOutput` (proto/tandem/v1/generation.proto), converted in services/common/convert.py.

Frozen and hashable like SamplingParams, which carries it; `key` is its canonical spelling (JSON
texts re-serialized with sorted keys), the compiled-grammar cache's key (engine/structured/compile.py).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass


class Kind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"
    TOOL_CALLS = "tool_calls"


@dataclass(frozen=True)
class ToolCallSpec:
    """`min_calls`..`max_calls` calls (0: no upper limit), each `begin` + a JSON value matching one of
    `schemas` (JSON Schema texts) + `end`, separated by `separator`."""

    begin: str
    end: str
    separator: str = ""
    schemas: tuple[str, ...] = ()
    min_calls: int = 1
    max_calls: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "schemas", tuple(self.schemas))


# How a thinking model's output opens (services/gateway/reasoning.py's parsers): a constraint with
# `reasoning` holds only after the thinking (engine/structured/compile.py).
REASONING_FORMATS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True)
class StructuredSpec:
    """One constraint. `value` by kind: the schema text (JSON_SCHEMA), the regex (REGEX), the grammar
    (GRAMMAR), the strings (CHOICE, a tuple), a ToolCallSpec (TOOL_CALLS), None (JSON_OBJECT).
    `strict` (JSON_SCHEMA): a keyword the decoder cannot enforce is an error instead of ignored.
    `reasoning` (one of REASONING_FORMATS, "" none): the model thinks freely first, then the
    constraint holds."""

    kind: Kind
    value: str | tuple[str, ...] | ToolCallSpec | None = None
    strict: bool = False
    reasoning: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.value, list):
            object.__setattr__(self, "value", tuple(self.value))

    @staticmethod
    def json_schema(schema: str | dict, strict: bool = False) -> StructuredSpec:
        return StructuredSpec(Kind.JSON_SCHEMA, schema if isinstance(schema, str) else json.dumps(schema), strict)

    @property
    def key(self) -> str:
        """The canonical spelling: equal constraints (a schema's keys in any order) give equal keys.
        Text that is not JSON stays as it is (compile rejects it with a message)."""
        v = self.value
        if self.kind is Kind.JSON_SCHEMA:
            v = _canonical_json(v)
        elif self.kind is Kind.TOOL_CALLS:
            v = [v.begin, v.end, v.separator, [_canonical_json(s) for s in v.schemas], v.min_calls, v.max_calls]
        head = [self.kind.value, v, self.strict] + ([self.reasoning] if self.reasoning else [])
        return json.dumps(head, separators=(",", ":"))


def _canonical_json(text: str) -> str:
    try:
        return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    except (ValueError, TypeError):
        return text
