"""tandem_client's output constraints on the wire, the dead-end finish reason, and parse_tool_calls."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel
from tandem_client import (
    Choice,
    Client,
    FinishReason,
    Grammar,
    JsonObject,
    JsonSchema,
    Regex,
    SamplingParams,
    Tool,
    ToolCall,
    ToolCalls,
    parse_tool_calls,
)

from tandem.v1 import generation_pb2 as pb
from tests.sdk.fake_router import FakeRouter

pytestmark = pytest.mark.timeout(60)


class City(BaseModel):
    name: str
    population: int


def test_each_constraint_goes_on_the_wire():
    weather = {"type": "object", "properties": {"city": {"type": "string"}}}
    with FakeRouter() as fake, Client(fake.addr) as client:
        client.generate("a", structured=JsonSchema.of(City, strict=True), max_tokens=1)
        client.generate("a", SamplingParams(max_tokens=1, structured=JsonObject()))
        client.generate("a", structured=Regex("[0-9]+"), max_tokens=1)
        client.generate("a", structured=Choice(["yes", "no"]), max_tokens=1)
        client.generate("a", structured=Grammar('start: "x"'), max_tokens=1)
        client.generate("a", structured=ToolCalls([Tool("get_weather", weather), Tool("now")], max_calls=1),
                        max_tokens=1)
        client.generate("a", max_tokens=1)
    s = [r.sampling.structured for r in fake.requests]
    assert json.loads(s[0].json_schema) == City.model_json_schema() and s[0].strict
    assert s[1].json_object and s[2].regex == "[0-9]+" and list(s[3].choice.choices) == ["yes", "no"]
    assert s[4].grammar == 'start: "x"'
    t = s[5].tool_calls
    assert (t.begin, t.end, t.separator, t.min_calls, t.max_calls) == ("<tool_call>\n", "\n</tool_call>", "\n", 1, 1)
    assert json.loads(t.schemas[0]) == {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"const": "get_weather"}, "arguments": weather}}
    assert json.loads(t.schemas[1])["properties"]["arguments"] == {"type": "object", "properties": {}}
    assert not fake.requests[6].sampling.HasField("structured")


def test_a_bad_constraint_type_is_a_type_error():
    with FakeRouter() as fake, Client(fake.addr) as client:
        with pytest.raises(TypeError):
            client.generate("a", structured={"type": "json_object"})
        with pytest.raises(TypeError):
            client.generate("a", structured=Choice("yes"))
    assert not fake.requests


def test_a_grammar_dead_end_is_its_own_finish_reason():
    def handler(req, context):
        yield pb.GenerateResponse(request_id=req.request_id, token_ids=[1], text='{"a": ',
                                  finish_reason=pb.FINISH_REASON_GRAMMAR_DEAD_END)

    with FakeRouter(handler) as fake, Client(fake.addr) as client:
        assert client.generate("a", structured=JsonObject()).finish_reason is FinishReason.GRAMMAR_DEAD_END


def test_parse_tool_calls_reads_the_hermes_format():
    text = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\nnot json\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": "{}"}')
    assert parse_tool_calls(text) == [ToolCall("get_weather", {"city": "Paris"}), ToolCall("now", {})]
    assert parse_tool_calls("no calls") == []
