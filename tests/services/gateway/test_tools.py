"""Tool calling at the gateway: `tools` / `tool_choice` checks, the grammar of required and named calls,
tools and the history rendered through chat templates, and the Hermes parser, whole and streamed."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from tokenizers import Tokenizer

from tandem.services.gateway.chat_template import render
from tandem.services.gateway.errors import APIError
from tandem.services.gateway.responses import finish_reason
from tandem.services.gateway.tool_parser import ToolCallParser, parse_tool_calls
from tandem.services.gateway.tools import inline_tools, parse_tool_use, template_renders_tools
from tandem.v1 import generation_pb2 as pb
from tests.fixtures.tiny_models import CHATML_TEMPLATE
from tests.sdk.fake_router import FakeRouter, prompt_len
from tests.services.gateway.conftest import MODEL, gateway_client, sse_events

pytestmark = pytest.mark.timeout(60)
MODELS = (pb.ModelInfo(id=MODEL, max_context_len=4096, vocab_size=512),)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
ANSWER = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')


# ---- the request ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("tools", "choice", "parallel", "param"), [
    ({"a": 1}, None, None, "tools"),
    ([{"type": "code_interpreter"}], None, None, "tools[0].type"),
    ([{"type": "function"}], None, None, "tools[0].function"),
    ([{"type": "function", "function": {"name": "has space"}}], None, None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "a", "description": 3}}], None, None, "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}], None, None,
     "tools[1].function.name"),
    ([TOOLS[1], {"type": "function", "function": {"name": "b", "parameters": {"type": "obj"}}}], None, None,
     "tools[1].function.parameters"),
    ([TOOLS[1], {"type": "function", "function": {"name": "b", "parameters": "{}"}}], None, None,
     "tools[1].function.parameters"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "tool_choice.function.name"),
    (TOOLS, {"type": "function"}, None, "tool_choice.function.name"),
    (TOOLS, "sometimes", None, "tool_choice"),
    (None, "required", None, "tool_choice"),
    (None, {"type": "function", "function": {"name": "now"}}, None, "tool_choice"),
    (TOOLS, "auto", "yes", "parallel_tool_calls"),
])
def test_bad_tools_name_the_field(tools, choice, parallel, param):
    with pytest.raises(APIError) as e:
        parse_tool_use(tools, choice, parallel)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_required_and_named_choices_make_a_tool_call_grammar():
    use = parse_tool_use(TOOLS, "required", None)
    fmt = use.constraint().structured.tool_calls
    assert (fmt.begin, fmt.end, fmt.separator, fmt.min_calls, fmt.max_calls) == \
        ("<tool_call>\n", "\n</tool_call>", "\n", 1, 0)
    schemas = [json.loads(s) for s in fmt.schemas]
    assert schemas[0] == {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER},
                          "required": ["name", "arguments"]}
    assert schemas[1]["properties"]["arguments"] == {"type": "object", "properties": {}}

    named = parse_tool_use(TOOLS, {"type": "function", "function": {"name": "now"}}, False).constraint()
    assert [json.loads(s)["properties"]["name"] for s in named.structured.tool_calls.schemas] == [{"const": "now"}]
    assert named.structured.tool_calls.max_calls == 1 and named.schema_params == ("tools[1].function.parameters",)
    assert parse_tool_use(TOOLS, "auto", None).constraint() is None
    assert not parse_tool_use(TOOLS, "none", None).offered
    assert parse_tool_use(None, "auto", None) is None and parse_tool_use([], "none", None) is None


# ---- the prompt -------------------------------------------------------------------------------------

HISTORY = [{"role": "system", "content": "Be brief."}, *ASK,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
               {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
           {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]


def test_a_template_without_tools_gets_them_written_into_the_messages():
    use = parse_tool_use(TOOLS, "auto", None)
    text = render(CHATML_TEMPLATE, inline_tools(HISTORY, use.tools), add_generation_prompt=True, special_tokens={})
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    for t in TOOLS:
        assert json.dumps({"type": "function", "function": {**t["function"], "parameters": t["function"].get(
            "parameters", {"type": "object", "properties": {}})}}) in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>\n'
            '<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\nnoon\n</tool_response>'
            '<|im_end|>\n<|im_start|>assistant\n') in text
    # no system message: the tool listing becomes one; no tools offered: only the history is rewritten
    assert inline_tools(ASK, use.tools)[0]["role"] == "system"
    assert inline_tools(HISTORY, ())[0] == {"role": "system", "content": "Be brief."}


HERMES_TEMPLATE = (  # a template that renders `tools` itself, in the format the gateway parses
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}"
    " answer with <tool_call> tags<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function.arguments | tojson }}</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_renders_tools_gets_them_as_its_variables(fake_tools, tiny_llama, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for f in tiny_llama.iterdir():
        if f.name not in ("tokenizer_config.json", "chat_template.jinja"):
            (folder / f.name).symlink_to(f)
    config = json.loads((tiny_llama / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE}))
    assert template_renders_tools(HERMES_TEMPLATE) and not template_renders_tools(CHATML_TEMPLATE)
    seen = []

    def handler(req, context):
        seen.append(req)
        yield from _answer(req, "ok")

    fake_tools.handler = handler
    r = chat_post(fake_tools, folder, {"messages": HISTORY, "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "ok"}
    prompt = Tokenizer.from_file(str(folder / "tokenizer.json")).decode(list(seen[0].token_ids.ids))
    assert "TOOLS:get_weather;now; answer with <tool_call> tags" in prompt
    assert '<tool_call>{"city": "Paris"}</tool_call><tool_call>{}</tool_call>' in prompt  # arguments as objects
    assert "\ntool\n18 C\ntool\nnoon" in prompt   # results stay `tool` turns: the template's business


def test_bad_history_arguments_are_a_400(fake_tools, tiny_llama):
    bad = [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                       "function": {"name": "now", "arguments": "{oops"}}]}]
    r = chat_post(fake_tools, tiny_llama, {"messages": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
    assert not fake_tools.requests


# ---- the parser -------------------------------------------------------------------------------------

CASES = [
    (ANSWER, "Let me look.", [("get_weather", '{"city": "Paris", "unit": "c"}'), ("now", "{}")]),
    ("plain text, <tool but no call\n", "plain text, <tool but no call\n", []),
    ('<tool_call>{"arguments": {"a": [1, "}"]}, "name": "f"}</tool_call>', "", [("f", '{"a": [1, "}"]}')]),
    ('<tool_call>\n{"name": "f", "arguments": {"s": "a}b\\"c{"}}\n</tool_call>\n\nDone.', "Done.",
     [("f", '{"s": "a}b\\"c{"}')]),
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}', "", [("f", '{"a": 1}')]),   # EOS before the end tag
    ('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', "", [("f", '{"a": 1}')]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1', "", [("f", '{"a": 1')]),     # cut by max_tokens
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_whole_output_parses_into_content_and_calls(text, content, calls):
    got_content, got = parse_tool_calls(text)
    assert got_content == content and [(c.name, c.arguments) for c in got] == calls
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in got)


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_streamed_deltas_reassemble_to_the_same_output_however_the_text_is_split(text, content, calls):
    rng = random.Random(0)
    for _ in range(100):
        parser, pieces, i = ToolCallParser(), [], 0
        while i < len(text):
            k = rng.randint(1, 6)
            pieces.append(parser.feed(text[i:i + k]))
            i += k
        pieces.append(parser.finish())
        assert "".join(p.content for p in pieces) == content
        assert reassemble([c for p in pieces for c in p.calls]) == calls


def test_the_start_of_a_call_is_held_back_and_its_first_delta_names_it():
    p = ToolCallParser()
    assert p.feed("Hi <tool").content == "Hi"
    assert p.feed("_call>\n{\"name\": \"get_weather\", \"argu").calls == []
    d = p.feed('ments": {"city": "Pa')
    assert d.calls == [{"index": 0, "id": p.calls[0].id, "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Pa'}}]
    assert p.feed('ris"}}\n</tool_call>').calls == [{"index": 0, "function": {"arguments": 'ris"}'}}]


def reassemble(entries: list[dict]) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for e in entries:
        if "id" in e:
            assert e["type"] == "function" and e["id"].startswith("call_") and e["index"] not in calls
            calls[e["index"]] = [e["function"]["name"], ""]
        calls[e["index"]][1] += e["function"].get("arguments", "")
    return [tuple(calls[i]) for i in sorted(calls)]


# ---- through the app --------------------------------------------------------------------------------

@pytest.fixture
def fake_tools():
    with FakeRouter(lambda req, ctx: _answer(req, ANSWER), models=MODELS) as f:
        yield f


def _answer(req, text: str, reason=pb.FINISH_REASON_STOP, step: int = 3):
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    for i, piece in enumerate(pieces):
        msg = pb.GenerateResponse(request_id=req.request_id, token_ids=[300 + i], text=piece)
        if i == len(pieces) - 1:
            msg.finish_reason = reason
            msg.usage.CopyFrom(pb.Usage(prompt_tokens=prompt_len(req), completion_tokens=len(pieces)))
        yield msg


def chat_post(fake, folder, body: dict):
    async def go():
        async with gateway_client(fake.addr, str(folder)) as (client, _gw):
            return await client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 64, **body})

    return asyncio.run(go())


def test_auto_calls_come_back_as_openai_tool_calls(fake_tools, tiny_llama):
    r = chat_post(fake_tools, tiny_llama, {"messages": ASK, "tools": TOOLS})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "Let me look."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        [("function", "get_weather", {"city": "Paris", "unit": "c"}), ("function", "now", {})]
    (req,) = fake_tools.requests
    assert not req.sampling.HasField("structured")   # auto: the model is free to answer in text


def test_streamed_tool_calls_reassemble_to_the_non_streaming_answer(fake_tools, tiny_llama):
    whole = chat_post(fake_tools, tiny_llama, {"messages": ASK, "tools": TOOLS, "tool_choice": "required"})
    r = chat_post(fake_tools, tiny_llama, {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    assert chunks[0]["delta"]["role"] == "assistant"
    content = "".join(c["delta"].get("content") or "" for c in chunks)
    calls = reassemble([t for c in chunks for t in c["delta"].get("tool_calls", [])])
    msg = whole.json()["choices"][0]["message"]
    assert content == msg["content"]
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
    assert [c["finish_reason"] for c in chunks].count("tool_calls") == 1 and chunks[-1]["finish_reason"] == "tool_calls"
    assert all(q.sampling.structured.tool_calls.min_calls == 1 for q in fake_tools.requests)


def test_tool_choice_none_offers_no_tools_and_parses_nothing(fake_tools, tiny_llama):
    r = chat_post(fake_tools, tiny_llama, {"messages": ASK, "tools": TOOLS, "tool_choice": "none"})
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": ANSWER} and choice["finish_reason"] == "stop"
    offered = chat_post(fake_tools, tiny_llama, {"messages": ASK, "tools": TOOLS})
    assert offered.status_code == 200
    none_req, auto_req = fake_tools.requests
    assert len(auto_req.token_ids.ids) > len(none_req.token_ids.ids) + 50   # the tool listing


def test_a_call_cut_short_finishes_with_length(fake_tools, tiny_llama):
    fake_tools.handler = lambda req, ctx: _answer(req, ANSWER[:60], pb.FINISH_REASON_LENGTH)
    choice = chat_post(fake_tools, tiny_llama, {"messages": ASK, "tools": TOOLS}).json()["choices"][0]
    assert choice["finish_reason"] == "length"


def test_a_finish_reason_the_gateway_does_not_know_is_never_stop():
    assert finish_reason(pb.FINISH_REASON_STOP) == "stop" and finish_reason(pb.FINISH_REASON_LENGTH) == "length"
    assert finish_reason(987) == "unknown_987"
