"""The Responses API's request side without a server: input items → chat messages, tools and
text.format checked with the chat API's code but named with the Responses API's fields."""

from __future__ import annotations

import functools

import pytest

from tandem.services.gateway.blocks import whole
from tandem.services.gateway.errors import APIError
from tandem.services.gateway.responses_items import (
    ResponsesRequest,
    input_messages,
    output_message,
    text_format,
    tool_use,
)
from tandem.services.gateway.tool_formats import create_tool_parser

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}


def test_a_string_input_is_one_user_message():
    messages, items = input_messages("hello")
    assert messages == [{"role": "user", "content": "hello"}]
    assert items[0]["type"] == "message" and items[0]["content"] == [{"type": "input_text", "text": "hello"}]


def test_items_become_chat_turns_with_calls_and_results():
    messages, items = input_messages([
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather"},
                                                        {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rain"},
    ])
    assert messages == [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "Weather\nin Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]
    assert [i["type"] for i in items] == ["message", "message", "function_call", "function_call",
                                          "function_call_output", "function_call_output"]
    assert len({i["id"] for i in items}) == len(items)


@pytest.mark.parametrize(("value", "param"), [
    ([{"role": "wizard", "content": "x"}], "input[0].role"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input[0].content[0]"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{nope"}], "input[0].arguments"),
    ([{"type": "function_call_output", "call_id": "c"}], "input[0].output"),
    (["text"], "input[0]"),
    ([{"type": "item_reference", "id": "x"}], "input[0].type"),
])
def test_bad_items_name_the_item(value, param):
    with pytest.raises(APIError) as e:
        input_messages(value)
    assert e.value.status == 400 and e.value.param == param


def test_the_output_is_kept_as_the_assistant_turn_without_its_reasoning():
    blocks = whole('<think>hm</think>Checking.\n<tool_call>\n{"name": "get_weather", "arguments": '
                   '{"city": "Paris"}}\n</tool_call>', "qwen3",
                   functools.partial(create_tool_parser, "hermes")).blocks
    msg = output_message(blocks)
    assert msg["content"] == "Checking." and msg["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": {"city": "Paris"}}
    assert output_message([]) is None


def test_flat_function_tools_and_a_named_choice():
    req = ResponsesRequest(input="x", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"})
    tools = tool_use(req)
    assert [t.name for t in tools.tools] == ["get_weather"] and tools.choice == "function"
    assert text_format(req, tools).param == "tool_choice"   # the named call's grammar


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "has space"}]}, "tools[0].name"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "obj"}}}}, "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
])
def test_bad_tools_and_formats_name_the_responses_field(body, param):
    req = ResponsesRequest(input="x", **body)
    with pytest.raises(APIError) as e:
        text_format(req, tool_use(req))
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert param.split("[")[0].split(".")[0] in e.value.message


def test_a_json_schema_format_is_a_schema_constraint():
    req = ResponsesRequest(input="x", text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER,
                                                       "strict": True}})
    c = text_format(req, None)
    assert c.param == "text.format.schema" and c.structured.strict
    assert '"city"' in c.structured.json_schema
