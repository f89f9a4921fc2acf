"""Anthropic's Messages request side without a server: blocks → chat messages, tools and tool_choice."""

from __future__ import annotations

import pytest

from tandem.services.gateway.errors import APIError
from tandem.services.gateway.messages_items import MessagesPrompt, chat_messages, system_messages, tool_use

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"name": "get_weather", "description": "Weather in a city", "input_schema": SCHEMA}


def test_system_and_blocks_become_chat_turns():
    assert system_messages([{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]) == [
        {"role": "system", "content": "be\nbrief"}]
    assert system_messages(None) == [] and system_messages("") == []
    messages = chat_messages([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "use the tool", "signature": ""},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
            {"type": "text", "text": "And tomorrow?"}]},
    ])
    assert messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]


@pytest.mark.parametrize(("messages", "param"), [
    ([], "messages"),
    ([{"role": "system", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image", "source": {}}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "tool_result"}]}], "messages[0].content[0].tool_use_id"),
    ([{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}],
     "messages[0].content[0].input"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": 3}]}],
     "messages[0].content[1].text"),
])
def test_bad_turns_name_the_block(messages, param):
    with pytest.raises(APIError) as e:
        chat_messages(messages)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize(("choice", "expected"), [
    (None, ("auto", None, True)),
    ({"type": "auto", "disable_parallel_tool_use": True}, ("auto", None, False)),
    ({"type": "any"}, ("required", None, True)),
    ({"type": "tool", "name": "get_weather"}, ("function", "get_weather", True)),
])
def test_tool_choice_maps_to_the_chat_sides(choice, expected):
    tools = tool_use(MessagesPrompt(messages=[], tools=[TOOL], tool_choice=choice))
    assert (tools.choice, tools.named, tools.parallel) == expected
    assert tools.tools[0].parameters == SCHEMA


@pytest.mark.parametrize(("tools", "choice", "param"), [
    ([{"type": "bash_20250124", "name": "bash"}], None, "tools[0]"),
    ([{**TOOL, "input_schema": {"type": "obj"}}], None, "tools[0].input_schema"),
    ([TOOL], {"type": "tool", "name": "nope"}, "tool_choice.name"),
    ([TOOL], {"type": "sometimes"}, "tool_choice.type"),
])
def test_bad_tools_name_anthropics_fields(tools, choice, param):
    with pytest.raises(APIError) as e:
        tool_use(MessagesPrompt(messages=[], tools=tools, tool_choice=choice))
    assert e.value.param == param, e.value.message
