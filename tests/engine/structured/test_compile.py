"""Grammar compilation and validation (torch-free, no tokenizer): what the router checks before any
worker is touched, the canonical cache key, and the tool-call grammar's language."""

from __future__ import annotations

import json

import pytest

from tandem.engine.errors import InvalidRequest
from tandem.engine.structured import compile as gc
from tandem.engine.structured_output import Kind, StructuredSpec, ToolCallSpec

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def test_equal_schemas_share_one_compiled_grammar():
    gc.clear_cache()
    a = StructuredSpec.json_schema(json.dumps(PERSON))
    b = StructuredSpec.json_schema(json.dumps(dict(reversed(PERSON.items())), indent=2))
    assert a.key == b.key
    assert gc.compile_grammar(a) == gc.compile_grammar(b)
    hits, misses, entries = gc.cache_info()
    assert (hits, misses, entries) == (1, 1, 1)
    assert StructuredSpec.json_schema(PERSON, strict=True).key != a.key


@pytest.mark.parametrize("spec, param, words", [
    (StructuredSpec.json_schema("{not json"), "structured.json_schema", "not valid JSON"),
    (StructuredSpec.json_schema("[1, 2]"), "structured.json_schema", "must be a JSON object"),
    (StructuredSpec.json_schema({"type": "objectx"}), "structured.json_schema", "Invalid type"),
    (StructuredSpec.json_schema({"type": "object", "propertyNames": {"pattern": "a"}}, strict=True),
     "structured.json_schema", "propertyNames"),
    (StructuredSpec(Kind.REGEX, "[a-"), "structured.regex", "unclosed character class"),
    (StructuredSpec(Kind.REGEX, ""), "structured.regex", "empty"),
    (StructuredSpec(Kind.CHOICE, ()), "structured.choice", "at least one"),
    (StructuredSpec(Kind.GRAMMAR, "start: foo\n"), "structured.grammar", "unknown name"),
    (StructuredSpec(Kind.TOOL_CALLS, ToolCallSpec("<t>", "</t>", "", ('{"type": 3}',))),
     "structured.tool_calls.schemas[0]", "type"),
    (StructuredSpec(Kind.TOOL_CALLS, ToolCallSpec("<t>", "</t>", "", ("{}",), min_calls=0)),
     "structured.tool_calls.min_calls", ">= 1"),
    (StructuredSpec(Kind.TOOL_CALLS, ToolCallSpec("<t>", "</t>", "", ("{}",), min_calls=3, max_calls=2)),
     "structured.tool_calls.max_calls", "below"),
])
def test_bad_constraints_are_refused_naming_the_field(spec, param, words):
    for _ in range(2):   # the cached error is raised again, the same
        with pytest.raises(InvalidRequest) as e:
            gc.compile_grammar(spec)
        assert e.value.param == param and words in e.value.message


def test_unsupported_keyword_is_ignored_unless_strict():
    schema = {"type": "object", "propertyNames": {"pattern": "^a"}}
    gc.compile_grammar(StructuredSpec.json_schema(schema))
    with pytest.raises(InvalidRequest):
        gc.compile_grammar(StructuredSpec.json_schema(schema, strict=True))


def test_every_kind_compiles():
    call = json.dumps({"type": "object", "properties": {"name": {"const": "get_weather"},
                                                        "arguments": PERSON}, "required": ["name", "arguments"]})
    for spec in (StructuredSpec(Kind.JSON_OBJECT), StructuredSpec.json_schema(PERSON, strict=True),
                 StructuredSpec(Kind.REGEX, r"\d{3}-[a-z]+"), StructuredSpec(Kind.CHOICE, ("yes", "no (a|b)?")),
                 StructuredSpec(Kind.GRAMMAR, 'start: "a"+ "b"\n'),
                 StructuredSpec(Kind.GRAMMAR, 'root ::= "yes" | "no"'),      # GBNF, as vLLM users send it
                 StructuredSpec(Kind.TOOL_CALLS, ToolCallSpec("<tool_call>\n", "\n</tool_call>", "\n", (call,), 1, 0))):
        assert gc.compile_grammar(spec)


def test_router_validation_rejects_before_any_worker():
    from tandem.services.common.convert import structured_to_pb
    from tandem.services.router.validation import validate_request
    from tandem.v1 import generation_pb2

    req = generation_pb2.GenerateRequest(text="hi", sampling=generation_pb2.SamplingParams(max_tokens=4))
    req.sampling.structured.CopyFrom(structured_to_pb(StructuredSpec(Kind.REGEX, "(")))
    with pytest.raises(InvalidRequest) as e:
        validate_request(req)
    assert e.value.param == "structured.regex"
    req.sampling.structured.CopyFrom(structured_to_pb(StructuredSpec(Kind.REGEX, "a+")))
    validate_request(req)


def test_wire_round_trip():
    from tandem.services.common.convert import sampling_from_pb, structured_to_pb
    from tandem.v1 import generation_pb2

    for spec in (StructuredSpec(Kind.JSON_OBJECT), StructuredSpec(Kind.CHOICE, ("a", "b")),
                 StructuredSpec.json_schema(PERSON, strict=True), StructuredSpec(Kind.REGEX, "x"),
                 StructuredSpec(Kind.GRAMMAR, 'start: "a"\n'),
                 StructuredSpec(Kind.TOOL_CALLS, ToolCallSpec("<a>", "</a>", "\n", ("{}",), 2, 0)),
                 StructuredSpec(Kind.CHOICE, ("a", "b"), reasoning="deepseek_r1")):
        sp = generation_pb2.SamplingParams(max_tokens=3)
        sp.structured.CopyFrom(structured_to_pb(spec))
        assert sampling_from_pb(sp).structured == spec
    assert sampling_from_pb(generation_pb2.SamplingParams(max_tokens=3)).structured is None
