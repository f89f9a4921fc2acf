"""Anthropic's Messages API through the official `anthropic` client, against the gateway app in this
process and a fake router that answers with scripted text."""

from __future__ import annotations

import asyncio
import json

import anthropic
import pydantic
import pytest
from tokenizers import Tokenizer

from tandem.services.gateway.tokenizer import GatewayTokenizer
from tandem.v1 import generation_pb2 as pb
from tests.sdk.fake_router import FakeRouter
from tests.services.gateway.conftest import MODEL, official_clients, scripted

pytestmark = pytest.mark.timeout(60)
MODELS = (pb.ModelInfo(id=MODEL, max_context_len=4096, vocab_size=512),)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": SCHEMA}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def run(folder, handler, scenario, **config):
    async def go():
        with FakeRouter(handler, models=MODELS) as fake:
            async with official_clients(fake.addr, str(folder), **config) as (_openai, client, gw):
                return await scenario(client, fake, gw)

    return asyncio.run(go())


def test_text_with_system_and_sampling(tiny_llama):
    async def scenario(client, fake, gw):
        # anthropic 2.x no longer names the sampling fields; the API takes them
        m = await client.messages.create(model=MODEL, max_tokens=20, system="Be brief.", messages=ASK,
                                         extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5})
        return m, fake.requests[0], gw.metrics.render().decode()

    m, req, metrics = run(tiny_llama, scripted("Sunny."), scenario)
    assert 'tandem_gateway_requests_total{endpoint="messages",status="200"} 1.0' in metrics
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [(b.type, b.text) for b in m.content] == [("text", "Sunny.")] and m.stop_reason == "end_turn"
    tok = GatewayTokenizer.from_folder(tiny_llama)
    ids = tok.encode(tok.apply_chat_template([{"role": "system", "content": "Be brief."}, *ASK]), False)
    assert list(req.token_ids.ids) == ids and m.usage.input_tokens == len(ids) and m.usage.output_tokens == 2
    s = req.sampling
    assert (s.max_tokens, s.top_k) == (20, 5) and s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)


def test_tool_use_and_tool_result_round_trip(tiny_llama):
    async def scenario(client, fake, gw):
        first = await client.messages.create(model=MODEL, max_tokens=64, tools=TOOLS, messages=ASK)
        fake.handler = scripted("It is sunny.")
        (use,) = [b for b in first.content if b.type == "tool_use"]
        second = await client.messages.create(model=MODEL, max_tokens=64, tools=TOOLS, messages=[
            *ASK, {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 24C"}]}])
        return first, use, second, [list(r.token_ids.ids) for r in fake.requests]

    first, use, second, sent = run(tiny_llama, scripted("Let me check.\n" + CALL), scenario)
    assert [b.type for b in first.content] == ["text", "tool_use"] and first.stop_reason == "tool_use"
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    assert second.content[0].text == "It is sunny." and second.stop_reason == "end_turn"
    assert sent[1][:len(sent[0])] == sent[0]      # the second turn's prompt extends the first's
    added = Tokenizer.from_file(str(tiny_llama / "tokenizer.json")).decode(sent[1][len(sent[0]):])
    assert "get_weather" in added and "sunny, 24C" in added


def test_stop_sequences(tiny_llama):
    async def scenario(client, fake, gw):
        m = await client.messages.create(model=MODEL, max_tokens=20, messages=ASK, stop_sequences=["END", "###"])
        return m, list(fake.requests[0].sampling.stop)

    m, stop = run(tiny_llama, scripted("Sunny", matched_stop="END"), scenario)
    assert stop == ["END", "###"]
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "END")


def test_max_tokens_stop_reason(tiny_llama):
    async def scenario(client, fake, gw):
        return await client.messages.create(model=MODEL, max_tokens=3, messages=ASK)

    assert run(tiny_llama, scripted("abcdefghi", pb.FINISH_REASON_LENGTH), scenario).stop_reason == "max_tokens"


def test_stream_events_with_thinking_and_a_tool_call(tiny_llama):
    async def scenario(client, fake, gw):
        async with client.messages.stream(model=MODEL, max_tokens=64, tools=TOOLS, messages=ASK) as s:
            events = [e async for e in s]
            final = await s.get_final_message()
        whole = await client.messages.create(model=MODEL, max_tokens=64, tools=TOOLS, messages=ASK)
        return events, final, whole

    events, final, whole = run(tiny_llama, scripted("<think>use the tool</think>Checking.\n" + CALL), scenario,
                               reasoning_parser="qwen3")
    raw = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                "content_block_stop", "message_delta", "message_stop")]
    collapsed = [k for i, k in enumerate(raw) if i == 0 or k != raw[i - 1]]
    assert collapsed == ["message_start"] + ["content_block_start", "content_block_delta",
                                             "content_block_stop"] * 3 + ["message_delta", "message_stop"]
    deltas = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert deltas == {"thinking_delta", "text_delta", "input_json_delta"}
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "use the tool" and final.content[1].text == "Checking."
    assert final.content[2].input == {"city": "Paris"} and final.stop_reason == "tool_use"
    def same(blocks):   # a call's id is new on every request
        return [{k: v for k, v in b.to_dict().items() if k not in ("id", "parsed_output")} for b in blocks]

    assert same(final.content) == same(whole.content)
    assert final.usage.output_tokens == whole.usage.output_tokens and final.usage.input_tokens > 0


def test_output_config_json_schema_constrains_the_router_request(tiny_llama):
    async def scenario(client, fake, gw):
        m = await client.messages.create(model=MODEL, max_tokens=20, messages=ASK, output_config={
            "format": {"type": "json_schema", "schema": SCHEMA}})
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.create(model=MODEL, max_tokens=20, messages=ASK, output_config={
                "format": {"type": "json_schema", "schema": {"type": "obj"}}})
        return m, fake.requests[0].sampling.structured, e.value.body, fake.calls

    m, structured, err, calls = run(tiny_llama, scripted('{"city": "Paris"}'), scenario)
    assert json.loads(structured.json_schema) == SCHEMA and m.content[0].text == '{"city": "Paris"}'
    assert "output_config.format.schema" in err["error"]["message"] and calls == 1


def test_the_clients_parse_helper_gets_a_typed_object(tiny_llama):
    class City(pydantic.BaseModel):
        city: str

    async def scenario(client, fake, gw):
        m = await client.messages.parse(model=MODEL, max_tokens=20, messages=ASK, output_format=City)
        return m, fake.requests[0].sampling.structured

    m, structured = run(tiny_llama, scripted('{"city": "Paris"}'), scenario)
    assert m.parsed_output == City(city="Paris") and json.loads(structured.json_schema)["required"] == ["city"]


def test_count_tokens_is_the_prompt_the_model_gets(tiny_llama):
    async def scenario(client, fake, gw):
        counted = await client.messages.count_tokens(model=MODEL, system="Be brief.", messages=ASK, tools=TOOLS)
        made = await client.messages.create(model=MODEL, max_tokens=4, system="Be brief.", messages=ASK, tools=TOOLS)
        return counted.input_tokens, made.usage.input_tokens, len(fake.requests[0].token_ids.ids)

    counted, used, sent = run(tiny_llama, scripted("ok"), scenario)
    assert counted == used == sent


def test_errors_are_in_anthropics_shape_and_x_api_key_is_accepted(tiny_llama):
    async def scenario(client, fake, gw):
        out = {}
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "robot", "content": "x"}])
        out["bad_role"] = e.value.body
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.create(model=MODEL, max_tokens=4, messages=ASK, extra_body={"temperature": 9})
        out["temperature"] = e.value.body
        with pytest.raises(anthropic.NotFoundError) as e:
            await client.messages.create(model="claude-x", max_tokens=4, messages=ASK)
        out["model"] = e.value.body
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.count_tokens(model=MODEL, messages=[])
        out["count"] = e.value.body
        wrong = client.with_options(api_key="wrong")
        with pytest.raises(anthropic.AuthenticationError) as e:
            await wrong.messages.create(model=MODEL, max_tokens=4, messages=ASK)
        out["auth"] = e.value.body
        http = client._client   # the raw transport: a body without max_tokens, and the key only as x-api-key
        r = await http.post("http://gateway/v1/messages", json={"model": MODEL, "messages": ASK},
                            headers={"x-api-key": "sk-test"})
        out["missing"] = (r.status_code, r.json())
        r = await http.get("http://gateway/v1/messages/nope", headers={"x-api-key": "sk-test"})
        out["unknown_path"] = (r.status_code, r.json())
        return out, fake.calls

    out, calls = run(tiny_llama, scripted("ok"), scenario)
    for key in ("bad_role", "temperature", "count", "missing"):
        body = out[key][1] if key == "missing" else out[key]
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", (key, body)
    assert "messages[0].role" in out["bad_role"]["error"]["message"]
    assert "temperature" in out["temperature"]["error"]["message"]
    assert out["missing"][0] == 400 and "max_tokens" in out["missing"][1]["error"]["message"]
    assert out["model"]["error"]["type"] == "not_found_error"
    assert out["unknown_path"] == (404, {"type": "error", "error": {
        "type": "not_found_error", "message": "Invalid URL (GET /v1/messages/nope): no such endpoint"}})
    assert out["auth"]["error"]["type"] == "authentication_error"
    assert calls == 0
