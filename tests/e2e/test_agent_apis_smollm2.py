"""The APIs agents speak, through the official `openai` and `anthropic` clients, against SmolLM2-135M-
Instruct (fp32, greedy) co-located and 1P1D over shm (slow: one stack per mode).

Responses: text; a forced function call whose arguments validate against the tool's schema, continued
with its `function_call_output` by `previous_response_id`; a strict json_schema answer parsed by
pydantic; five turns chained by `previous_response_id`, each reusing the KV of the turns before it; a
call cut by `max_output_tokens` reported as such; streams whose events are complete and in order.
Messages: forced tool_use, its tool_result answered with text, and the stream of a tool_use.
(The protocol details are unit-tested against a fake router, tests/services/gateway/; here the model
is real, the prompts hold the tools, and the KV travels prefill -> decode.)
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.e2e.stack import Stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

MODES = {
    "colocated": ("--mode", "colocated"),
    "1p1d-shm": ("--transfer-backend", "shm"),
}
MODEL = "smollm2-135m"
PAGE = 16            # --page-size: the prefix cache hits whole pages
GREEDY = {"temperature": 0}


class Weather(BaseModel):
    # additionalProperties false: the decoder writes no key the schema does not name.
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=24)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


class Capital(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)


ASK = "What's the weather like in Paris?"
FUNCTION = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
            "parameters": Weather.model_json_schema()}
TOOL = {"name": "get_weather", "description": "Current weather in a city", "input_schema": Weather.model_json_schema()}


@pytest.fixture(scope="module", params=list(MODES))
def stack(request):
    stack = Stack("--model", "smollm2-135m", "--dtype", "float32", "--kv-cache-gb", "0.25", "--page-size", str(PAGE),
                  *MODES[request.param], gateway=True)
    request.addfinalizer(stack.close)
    return stack


@pytest.fixture(scope="module")
def oai(stack):
    with openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def claude(stack):
    with anthropic.Anthropic(base_url=stack.gateway_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def cached_at_least(previous_prompt_tokens: int) -> int:
    """What a prompt that begins with a previous one finds in the prefix cache: its whole pages."""
    return previous_prompt_tokens // PAGE * PAGE


# ---- Responses ------------------------------------------------------------------------------------

def test_responses_text(oai):
    r = oai.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=24, **GREEDY)
    assert r.status == "completed" and [o.type for o in r.output] == ["message"]
    assert "Paris" in r.output_text and 0 < r.usage.output_tokens <= 24
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_responses_forced_call_then_its_output_continues_the_conversation(oai):
    first = oai.responses.create(model=MODEL, input=ASK, tools=[FUNCTION], parallel_tool_calls=False,
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64, **GREEDY)
    assert first.status == "completed", first
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_")
    Weather.model_validate_json(call.arguments)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 18}'}
    second = oai.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=[FUNCTION],
                                  max_output_tokens=32, **GREEDY)
    assert second.previous_response_id == first.id
    assert [o.type for o in second.output] == ["message"] and second.output_text.strip()
    # the follow-up's prompt is the first one, the call and its result: the first's KV is reused
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= cached_at_least(first.usage.input_tokens)


def test_responses_strict_json_schema(oai):
    # Asked in prose, SmolLM2 answers in prose: the JSON comes from the constraint.
    r = oai.responses.parse(model=MODEL, input="Name the capital city of France and its country.",
                            text_format=Capital, max_output_tokens=40, **GREEDY)
    assert r.status == "completed" and r.text.format.type == "json_schema" and r.text.format.strict
    assert isinstance(r.output_parsed, Capital) and r.output_parsed == Capital.model_validate_json(r.output_text)
    assert "Paris" in r.output_parsed.city


def test_responses_five_turns_reuse_the_kv_of_the_turns_before(oai):
    turns = ["Name a fruit.", "What colour is it?", "Name another fruit.", "Which one is sweeter?", "Say goodbye."]
    previous = None
    for i, question in enumerate(turns):
        r = oai.responses.create(model=MODEL, instructions="Answer in one short sentence.", input=question,
                                 previous_response_id=previous.id if previous else None, max_output_tokens=16,
                                 **GREEDY)
        assert r.output_text.strip() and r.previous_response_id == (previous.id if previous else None)
        if i:   # the history (earlier questions and answers) is in the prompt, and found in the cache
            assert r.usage.input_tokens > previous.usage.input_tokens + previous.usage.output_tokens, i
            assert r.usage.input_tokens_details.cached_tokens >= cached_at_least(previous.usage.input_tokens) > 0, i
            assert r.usage.input_tokens_details.cached_tokens < r.usage.input_tokens
        previous = r
    assert [i.content[0].text for i in oai.responses.input_items.list(previous.id).data] == [turns[-1]]


def test_responses_a_call_cut_by_max_output_tokens_is_incomplete(oai):
    """With parallel calls allowed, SmolLM2 repeats the call until the limit: the whole first call is
    `completed`, the one cut short `incomplete`, streamed or not."""
    ask = dict(model=MODEL, input=ASK, tools=[FUNCTION], tool_choice="required", max_output_tokens=60, **GREEDY)
    whole = oai.responses.create(**ask)
    with oai.responses.stream(**ask) as s:
        events = list(s)
    streamed = check_response_stream(events)
    for r in (whole, streamed):
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert [(o.type, o.status) for o in r.output] == [("function_call", "completed"),
                                                          ("function_call", "incomplete")]
        Weather.model_validate_json(r.output[0].arguments)
    assert [o.arguments for o in streamed.output] == [o.arguments for o in whole.output]
    assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["completed", "incomplete"]


# Each output item's events in order: added, (content part added), deltas, done, (part done), item done.
PHASES = {"response.output_item.added": 0, "response.content_part.added": 1, "response.output_text.delta": 2,
          "response.function_call_arguments.delta": 2, "response.output_text.done": 3,
          "response.function_call_arguments.done": 3, "response.content_part.done": 4,
          "response.output_item.done": 5}
ITEM_PHASES = {"message": [0, 1, 2, 3, 4, 5], "function_call": [0, 2, 3, 5]}


def check_response_stream(events: list):
    """Asserts a Responses stream is complete and in order; returns its final response."""
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    middle = events[2:-1]
    assert all(e.type in PHASES for e in middle), kinds
    steps = [(e.output_index, PHASES[e.type]) for e in middle]
    assert steps == sorted(steps), kinds          # item after item, each one's events in order
    assert sorted({i for i, _ in steps}) == list(range(len(final.output)))
    for i, item in enumerate(final.output):
        mine = [e for e in middle if e.output_index == i]
        phases = [p for at, p in steps if at == i]
        assert [p for k, p in enumerate(phases) if k == 0 or p != phases[k - 1]] == ITEM_PHASES[item.type], kinds
        assert {getattr(e, "item_id", None) or e.item.id for e in mine} == {item.id}
        deltas = "".join(e.delta for e in mine if PHASES[e.type] == 2)
        (done,) = [e for e in mine if PHASES[e.type] == 3]
        whole = item.content[0].text if item.type == "message" else item.arguments
        assert deltas == whole == (done.text if item.type == "message" else done.arguments)
    return final


def test_responses_stream_of_text_is_complete_and_in_order(oai):
    ask = dict(model=MODEL, input="What is the capital of France?", max_output_tokens=24, **GREEDY)
    with oai.responses.stream(**ask) as s:
        events = list(s)
        final = s.get_final_response()
    streamed = check_response_stream(events)
    assert streamed.status == "completed" and [o.type for o in streamed.output] == ["message"]
    assert final.output_text == streamed.output_text == oai.responses.create(**ask).output_text
    assert oai.responses.retrieve(final.id).output_text == final.output_text   # the stream's response is kept


def test_responses_stream_of_a_call_is_complete_and_in_order(oai):
    with oai.responses.stream(model=MODEL, input=ASK, tools=[FUNCTION], tool_choice="required",
                              parallel_tool_calls=False, max_output_tokens=64, **GREEDY) as s:
        events = list(s)
    final = check_response_stream(events)
    assert final.status == "completed" and [o.type for o in final.output] == ["function_call"]
    assert final.output[0].name == "get_weather" and final.output[0].status == "completed"
    Weather.model_validate_json(final.output[0].arguments)
    assert sum(e.type == "response.function_call_arguments.delta" for e in events) > 1   # streamed, not whole


# ---- Messages -------------------------------------------------------------------------------------

def test_messages_forced_tool_use_then_its_result_gives_text(claude):
    ask = [{"role": "user", "content": ASK}]
    first = claude.messages.create(model=MODEL, max_tokens=64, messages=ask, tools=[TOOL], extra_body=GREEDY,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert first.stop_reason == "tool_use", first
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "get_weather"
    Weather.model_validate(use.input)
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "18 degrees celsius, sunny"}
    second = claude.messages.create(model=MODEL, max_tokens=32, tools=[TOOL], extra_body=GREEDY, messages=[
        *ask, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}])
    assert [b.type for b in second.content] == ["text"] and second.content[0].text.strip()
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert second.usage.cache_read_input_tokens >= cached_at_least(first.usage.input_tokens)


RAW = {"message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
       "message_stop"}
BLOCK_PHASES = {"content_block_start": 0, "content_block_delta": 1, "content_block_stop": 2}


def test_messages_stream_of_a_tool_use_is_complete_and_in_order(claude):
    with claude.messages.stream(model=MODEL, max_tokens=64, messages=[{"role": "user", "content": ASK}],
                                tools=[TOOL], extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
                                ) as s:
        events = [e for e in s if e.type in RAW]     # the client's own derived events left out
        final = s.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    assert final.stop_reason == events[-2].delta.stop_reason == "tool_use"
    assert events[0].message.usage.input_tokens == final.usage.input_tokens > 0
    assert events[-2].usage.output_tokens == final.usage.output_tokens > 0
    blocks = events[1:-2]
    steps = [(e.index, BLOCK_PHASES[e.type]) for e in blocks]
    assert steps == sorted(steps), kinds          # block after block, each one's events in order
    assert [st for k, st in enumerate(steps) if k == 0 or st != steps[k - 1]] == \
        [(i, p) for i in range(len(final.content)) for p in (0, 1, 2)], kinds
    assert [b.type for b in final.content] == ["tool_use"] and final.content[0].name == "get_weather"
    use = final.content[0]
    assert blocks[0].content_block.type == "tool_use" and blocks[0].content_block.id == use.id
    deltas = blocks[1:-1]
    assert len(deltas) > 1 and {e.delta.type for e in deltas} == {"input_json_delta"}
    assert json.loads("".join(e.delta.partial_json for e in deltas)) == use.input
    Weather.model_validate(use.input)
