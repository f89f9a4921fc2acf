"""OpenAI's Responses API through the official `openai` client, against the gateway app in this
process and a fake router that answers with scripted text."""

from __future__ import annotations

import asyncio
import json

import openai
import pydantic
import pytest
from tokenizers import Tokenizer

from tandem.services.gateway.tokenizer import GatewayTokenizer
from tandem.v1 import generation_pb2 as pb
from tests.sdk.fake_router import FakeRouter
from tests.services.gateway.conftest import MODEL, official_clients, scripted

pytestmark = pytest.mark.timeout(60)
MODELS = (pb.ModelInfo(id=MODEL, max_context_len=4096, vocab_size=512),)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def run(folder, handler, scenario, **config):
    async def go():
        with FakeRouter(handler, models=MODELS) as fake:
            async with official_clients(fake.addr, str(folder), **config) as (client, _anthropic, gw):
                return await scenario(client, fake, gw)

    return asyncio.run(go())


def prompts(fake) -> list[list[int]]:
    return [list(r.token_ids.ids) for r in fake.requests]


def test_text_with_instructions_and_usage(tiny_llama):
    async def scenario(client, fake, gw):
        r = await client.responses.create(model=MODEL, instructions="Be brief.", input="Capital of France?",
                                          max_output_tokens=20, temperature=0.5, top_p=0.9)
        return r, prompts(fake), fake, gw.metrics.render().decode()

    r, sent, fake, metrics = run(tiny_llama, scripted("Paris."), scenario)
    assert 'tandem_gateway_requests_total{endpoint="responses",status="200"} 1.0' in metrics
    assert r.status == "completed" and r.output_text == "Paris." and r.id.startswith("resp_")
    assert [o.type for o in r.output] == ["message"]
    tok = GatewayTokenizer.from_folder(tiny_llama)
    ids = tok.encode(tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Capital of France?"}]), False)
    assert sent == [ids] and r.usage.input_tokens == len(ids) and r.usage.output_tokens == 2
    s = fake.requests[0].sampling
    assert s.max_tokens == 20 and s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)
    assert r.temperature == pytest.approx(0.5) and r.max_output_tokens == 20 and r.instructions == "Be brief."


def test_previous_response_id_over_several_turns_prompts_the_whole_conversation(tiny_llama):
    async def scenario(client, fake, gw):
        first = await client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=8)
        second = await client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=8,
                                               previous_response_id=first.id)
        third = await client.responses.create(model=MODEL, input="Spell it.", max_output_tokens=8,
                                              previous_response_id=second.id)
        items = await client.responses.input_items.list(third.id, order="asc")
        return (first, second, third), prompts(fake), items

    (first, second, third), sent, items = run(tiny_llama, scripted("Noted."), scenario)
    assert second.previous_response_id == first.id and third.previous_response_id == second.id
    # each turn's prompt begins with the one before it: the KV of earlier turns is reused
    assert sent[1][:len(sent[0])] == sent[0] and sent[2][:len(sent[1])] == sent[1]
    tok = GatewayTokenizer.from_folder(tiny_llama)
    conversation = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "Noted."},
                    {"role": "user", "content": "What is my name?"}, {"role": "assistant", "content": "Noted."},
                    {"role": "user", "content": "Spell it."}]
    assert sent[2] == tok.encode(tok.apply_chat_template(conversation), False)
    assert [i.content[0].text for i in items.data] == ["Spell it."]   # this turn's own input


def test_tool_call_round_trip(tiny_llama):
    async def scenario(client, fake, gw):
        first = await client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS,
                                              max_output_tokens=64)
        (call,) = [o for o in first.output if o.type == "function_call"]
        fake.handler = scripted("It is sunny in Paris.")
        second = await client.responses.create(
            model=MODEL, tools=TOOLS, previous_response_id=first.id, max_output_tokens=64,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24C"}])
        return first, call, second, prompts(fake)

    first, call, second, sent = run(tiny_llama, scripted("Let me check.\n" + CALL), scenario)
    assert [o.type for o in first.output] == ["message", "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and first.status == "completed"
    assert second.output_text == "It is sunny in Paris."
    assert sent[1][:len(sent[0])] == sent[0]
    added = Tokenizer.from_file(str(tiny_llama / "tokenizer.json")).decode(sent[1][len(sent[0]):])
    assert "get_weather" in added and "sunny, 24C" in added   # the call and its result follow the first prompt


def test_json_schema_format_constrains_the_router_request(tiny_llama):
    async def scenario(client, fake, gw):
        r = await client.responses.create(model=MODEL, input="Weather?", max_output_tokens=30, text={"format": {
            "type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}})
        return r, fake.requests[0].sampling.structured

    r, structured = run(tiny_llama, scripted('{"city": "Paris"}'), scenario)
    assert json.loads(structured.json_schema) == WEATHER and structured.strict
    assert json.loads(r.output_text) == {"city": "Paris"} and r.text.format.type == "json_schema"


def test_the_clients_parse_helper_gets_a_typed_object(tiny_llama):
    class City(pydantic.BaseModel):
        city: str

    async def scenario(client, fake, gw):
        r = await client.responses.parse(model=MODEL, input="Weather?", max_output_tokens=30, text_format=City)
        return r, fake.requests[0].sampling.structured

    r, structured = run(tiny_llama, scripted('{"city": "Paris"}'), scenario)
    assert r.output_parsed == City(city="Paris") and json.loads(structured.json_schema)["required"] == ["city"]


def test_store_false_keeps_nothing(tiny_llama):
    async def scenario(client, fake, gw):
        r = await client.responses.create(model=MODEL, input="hi", max_output_tokens=4, store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model=MODEL, input="again", previous_response_id=r.id, max_output_tokens=4)
        return e.value.body, fake.calls

    body, calls = run(tiny_llama, scripted("ok"), scenario)
    assert body["param"] == "previous_response_id" and "not found" in body["message"]
    assert calls == 1   # the refused follow-up reached no worker


def test_stream_events_are_complete_and_in_order(tiny_llama):
    async def scenario(client, fake, gw):
        async with client.responses.stream(model=MODEL, input="Weather?", tools=TOOLS, max_output_tokens=64) as s:
            events = [e async for e in s]
            final = await s.get_final_response()
        stored = await client.responses.retrieve(final.id)
        return events, final, stored

    events, final, stored = run(tiny_llama, scripted("<think>use the tool</think>Checking.\n" + CALL),
                                scenario, reasoning_parser="qwen3")
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert collapsed == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Checking."
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "use the tool" and final.output_text == "Checking."
    assert json.loads(final.output[2].arguments) == {"city": "Paris"}
    assert [o.id for o in stored.output] == [o.id for o in final.output]   # the store keeps what was streamed
    assert stored.output_text == final.output_text and stored.usage == final.usage


def test_a_response_cut_by_max_output_tokens_is_incomplete(tiny_llama):
    async def scenario(client, fake, gw):
        whole = await client.responses.create(model=MODEL, input="hi", max_output_tokens=3)
        stream = await client.responses.create(model=MODEL, input="hi", max_output_tokens=3, stream=True)
        return whole, [e async for e in stream]

    whole, events = run(tiny_llama, scripted("abcdefghi", pb.FINISH_REASON_LENGTH), scenario)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == "abcdefghi"
    assert whole.output[0].status == events[-1].response.output[0].status == "incomplete"
    (done,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert done.status == "incomplete"


def test_only_the_item_the_limit_cut_is_incomplete(tiny_llama):
    """A second call cut mid-arguments: the first is whole, the second says it is not (a client must
    not run it), in the body, the stream's output_item.done events, and the kept response."""
    async def scenario(client, fake, gw):
        ask = dict(model=MODEL, input="Weather?", tools=TOOLS, max_output_tokens=40)
        whole = await client.responses.create(**ask)
        events = [e async for e in await client.responses.create(**ask, stream=True)]
        return whole, events, await client.responses.retrieve(events[-1].response.id)

    cut = CALL + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ly'
    whole, events, stored = run(tiny_llama, scripted(cut, pb.FINISH_REASON_LENGTH), scenario)
    for response in (whole, events[-1].response, stored):
        assert response.status == "incomplete"
        assert [(o.type, o.status) for o in response.output] == [("function_call", "completed"),
                                                                  ("function_call", "incomplete")]
        assert json.loads(response.output[0].arguments) == {"city": "Paris"}
    assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["completed", "incomplete"]
    ok = run(tiny_llama, scripted(CALL), lambda client, fake, gw: client.responses.create(
        model=MODEL, input="Weather?", tools=TOOLS, max_output_tokens=40))
    assert [o.status for o in ok.output] == ["completed"] and ok.status == "completed"


def test_get_delete_cancel_and_unknown_ids(tiny_llama):
    async def scenario(client, fake, gw):
        r = await client.responses.create(model=MODEL, input="hi", max_output_tokens=4)
        got = await client.responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError):
            await client.responses.cancel(r.id)
        await client.responses.delete(r.id)
        errors = []
        for call in (client.responses.retrieve, client.responses.delete, client.responses.cancel,
                     client.responses.input_items.list):
            with pytest.raises(openai.NotFoundError) as e:
                await call(r.id)
            errors.append(e.value.body["type"])
        return r, got, errors

    r, got, errors = run(tiny_llama, scripted("ok"), scenario)
    assert got.id == r.id and got.output_text == "ok"
    assert errors == ["invalid_request_error"] * 4


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "x", "temperature": 5}, "temperature"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({}, "input"),
])
def test_bad_requests_are_400_naming_the_field(tiny_llama, body, param):
    async def scenario(client, fake, gw):
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model=MODEL, **body)
        return e.value.body, fake.calls

    err, calls = run(tiny_llama, scripted("x"), scenario)
    assert err["param"] == param and err["type"] == "invalid_request_error" and calls == 0
