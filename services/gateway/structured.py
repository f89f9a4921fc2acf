"""What the output must match: the request's constraint fields → one `StructuredOutput` (proto).

Accepted spellings, at most one per request (two are a 400 naming both):
  OpenAI   `response_format` {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
  vLLM     `structured_outputs` {"json" | "regex" | "choice" | "grammar" | "json_object": ...}, and the older
           `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`
  SGLang   `regex`, `json_schema`, `ebnf`
Tool calling adds its own constraint (tools.py) and counts as one more.

One dialect: a schema, regex or grammar is judged by the library that enforces it, in the one place
the gRPC path uses too (engine/structured/compile.py, llguidance: `\\p{L}+` is a regex there, Python's
`re` would refuse it), before the request leaves the gateway; its error names the field the request
used (`Constraint.explain`). Here only the JSON shapes of the fields are checked (a schema given as
text parses, a choice list holds non-empty strings).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from tandem.engine.errors import InvalidRequest
from tandem.engine.structured.compile import validate_structured
from tandem.engine.structured_output import StructuredSpec
from tandem.services.common.convert import structured_from_pb
from tandem.services.gateway.errors import APIError, bad_request
from tandem.v1 import generation_pb2 as pb


@dataclass(frozen=True)
class Constraint:
    """One request's constraint: the proto, and the request field it came from (for error messages).
    `schema_params[i]` names the field of tool-call schema i (tools[k].function.parameters)."""

    structured: pb.StructuredOutput
    param: str
    schema_params: tuple[str, ...] = ()

    def explain(self, err: APIError) -> APIError:
        """A router/worker 400 about `structured...` renamed to the field the request used."""
        if err.status != 400 or (err.param and not err.param.startswith("structured")):
            return err
        param = self.param
        m = re.search(r"schemas\[(\d+)\]", err.param or "")
        if m and int(m.group(1)) < len(self.schema_params):
            param = self.schema_params[int(m.group(1))]
        message = err.message
        if err.param and err.param in message:   # the router names the wire field: say the request's
            message = message.replace(err.param, param, 1)
        if not message.startswith(param):
            message = f"{param}: {message}"
        return APIError(400, message, param, err.code)


    def validate(self) -> None:
        """Raise the 400 the gRPC path would give (the same check: engine/structured/compile.py),
        naming the request's field."""
        try:
            validate_structured(structured_from_pb(self.structured))
        except InvalidRequest as e:
            raise self.explain(APIError(400, e.message, e.param or "structured")) from None


def check_schema(schema: Any, param: str) -> None:
    """Raise a 400 naming `param` unless llguidance (what enforces it) takes `schema` as a JSON Schema."""
    if not isinstance(schema, dict | bool):
        raise bad_request(f"{param} must be a JSON Schema (an object), got {type(schema).__name__}", param)
    try:
        validate_structured(StructuredSpec.json_schema(json.dumps(schema)))
    except InvalidRequest as e:
        message = e.message.replace("structured.json_schema", param, 1)
        raise bad_request(message if message.startswith(param) else f"{param}: {message}", param) from None


def schema_text(value: Any, param: str) -> str:
    """A schema given as an object or as JSON text → JSON text (judged with the rest: `validate`)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise bad_request(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(value, dict | bool):
        raise bad_request(f"{param} must be a JSON Schema (an object), got {type(value).__name__}", param)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _regex(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string (a regular expression)", param)
    return value


def _choices(value: Any, param: str) -> list[str]:
    if not isinstance(value, list) or not value:
        raise bad_request(f"{param} must be a non-empty list of strings", param)
    for i, c in enumerate(value):
        if not isinstance(c, str) or not c:
            raise bad_request(f"{param}[{i}] must be a non-empty string", f"{param}[{i}]")
    return value


def _grammar(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"{param} must be a non-empty string (a grammar)", param)
    return value


def _from_response_format(rf: Any) -> Constraint | None:
    if not isinstance(rf, dict):
        raise bad_request("response_format must be an object", "response_format")
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(pb.StructuredOutput(json_object=True), "response_format")
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          "response_format.type")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise bad_request("response_format.json_schema must be an object with `name` and `schema`",
                          "response_format.json_schema")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict")
    if "schema" not in js:
        raise bad_request("response_format.json_schema.schema is required", "response_format.json_schema.schema")
    param = "response_format.json_schema.schema"
    return Constraint(pb.StructuredOutput(json_schema=schema_text(js["schema"], param), strict=bool(strict)), param)


# vLLM's structured_outputs keys, and the flat fields that mean the same: field → (kind, check)
_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
          "json_object": "json_object"}
FLAT_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
               "regex": "regex", "json_schema": "json", "ebnf": "grammar"}


def _one(key: str, value: Any, param: str) -> Constraint:
    if key == "json":
        return Constraint(pb.StructuredOutput(json_schema=schema_text(value, param)), param)
    if key == "regex":
        return Constraint(pb.StructuredOutput(regex=_regex(value, param)), param)
    if key == "choice":
        return Constraint(pb.StructuredOutput(choice=pb.ChoiceList(choices=_choices(value, param))), param)
    if key == "grammar":
        return Constraint(pb.StructuredOutput(grammar=_grammar(value, param)), param)
    assert key == "json_object"
    return Constraint(pb.StructuredOutput(json_object=True), param)


def constraints(response_format: Any, structured_outputs: Any, flat: dict[str, Any]) -> list[Constraint]:
    """Every constraint the request sets, in the order of the spellings above (validated)."""
    out: list[Constraint] = []
    if response_format is not None and (c := _from_response_format(response_format)) is not None:
        out.append(c)
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            raise bad_request("structured_outputs must be an object", "structured_outputs")
        if structured_outputs.get("structural_tag") is not None:
            raise bad_request("structured_outputs.structural_tag is not supported", "structured_outputs.structural_tag")
        for key in _KINDS:
            value = structured_outputs.get(key)
            if value is None or (key == "json_object" and value is False):
                continue
            if key == "json_object" and value is not True:
                raise bad_request("structured_outputs.json_object must be a boolean", "structured_outputs.json_object")
            out.append(_one(key, value, f"structured_outputs.{key}"))
    for name, key in FLAT_FIELDS.items():
        if flat.get(name) is not None:
            out.append(_one(key, flat[name], name))
    return out


def after_thinking(c: Constraint | None, reasoning: str | None) -> Constraint | None:
    """A chat request's constraint with a thinking model (--reasoning-parser): it holds once the model
    has thought (docs/structured-output.md), which the reasoning parser then splits off as reasoning."""
    if c is None or not reasoning:
        return c
    structured = pb.StructuredOutput()
    structured.CopyFrom(c.structured)
    structured.reasoning = reasoning
    return dataclasses.replace(c, structured=structured)


def only_one(found: list[Constraint]) -> Constraint | None:
    """The request's one constraint, judged (`Constraint.validate`); two or more are a 400 naming them."""
    if len(found) > 1:
        names = ", ".join(c.param.split(".")[0] for c in found)
        raise bad_request(f"a request takes one output constraint; this one sets {len(found)}: {names}",
                          found[1].param.split(".")[0])
    if found:
        found[0].validate()
    return found[0] if found else None
