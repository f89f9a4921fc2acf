"""The Responses and Messages APIs through the official `openai` and `anthropic` clients against the
live 1P1D stack the gateway e2e tests share (`tandem up`: its gateway keeps responses in the stack's
Redis). Short outputs: the tiny model's text is noise; what is checked is the protocol, the store,
and that a continued conversation reuses the KV of the turns before it. (Tool calls are covered
against a fake router, and with SmolLM2 in test_agent_apis_smollm2.py: the tools prompt is longer
than the tiny model's 512-token context.)"""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.e2e.stack import API_KEY, gateway_stack

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def stack(request, tiny_llama):
    return gateway_stack(request.config, tiny_llama)


@pytest.fixture(scope="module")
def oai(stack):
    with openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def claude(stack):
    with anthropic.Anthropic(base_url=stack.gateway_url, api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model(tiny_llama) -> str:
    return str(tiny_llama)


def test_responses_conversation_reuses_the_earlier_turns_kv(oai, model):
    first = oai.responses.create(model=model, instructions="Answer briefly.", input="Name a colour.",
                                 max_output_tokens=6, temperature=0)
    assert first.status in ("completed", "incomplete") and first.usage.output_tokens <= 6
    second = oai.responses.create(model=model, instructions="Answer briefly.", input="Another one.",
                                  previous_response_id=first.id, max_output_tokens=6, temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0       # the first turn's pages, from the cache
    assert oai.responses.retrieve(second.id).output_text == second.output_text   # kept in the stack's Redis
    assert [i.content[0].text for i in oai.responses.input_items.list(second.id).data] == ["Another one."]


def test_responses_stream(oai, model):
    with oai.responses.stream(model=model, input="Say hi.", max_output_tokens=5, temperature=0) as s:
        events = list(s)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text


def test_messages_create_stream_and_count_tokens(claude, model):
    ask = [{"role": "user", "content": "Name a colour."}]
    counted = claude.messages.count_tokens(model=model, system="Be brief.", messages=ask).input_tokens
    made = claude.messages.create(model=model, max_tokens=5, system="Be brief.", messages=ask)
    assert made.usage.input_tokens == counted and made.stop_reason in ("end_turn", "max_tokens")
    with claude.messages.stream(model=model, max_tokens=5, system="Be brief.", messages=ask) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.content[0].text == streamed and final.usage.output_tokens <= 5
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=model, max_tokens=5, messages=[])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
