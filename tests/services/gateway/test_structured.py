"""Output constraints at the gateway: every accepted spelling → StructuredOutput, and the 400s that need
no grammar library (each naming its field), through the app in front of a fake router."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from tandem.services.gateway.errors import APIError
from tandem.services.gateway.structured import check_schema, constraints
from tandem.v1 import generation_pb2 as pb
from tests.sdk.fake_router import FakeRouter, failing
from tests.services.gateway.conftest import MODEL, gateway_client

pytestmark = pytest.mark.timeout(60)
CHAT = [{"role": "user", "content": "hi"}]
MODELS = (pb.ModelInfo(id=MODEL, max_context_len=4096, vocab_size=512),)  # room for a tool listing
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name"]}


@pytest.fixture
def fake():
    with FakeRouter(models=MODELS) as f:
        yield f


def post(fake, tiny_llama, path: str, bodies: list[dict]):
    async def go():
        async with gateway_client(fake.addr, str(tiny_llama)) as (client, _gw):
            return [await client.post(path, json=b) for b in bodies]

    return asyncio.run(go())


def chat(**extra) -> dict:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 2, **extra}


def test_every_spelling_reaches_the_router_as_one_structured_output(fake, tiny_llama):
    cases = [
        (chat(response_format={"type": "json_object"}), ("json_object", True)),
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}),
         ("json_schema", SCHEMA)),
        (chat(structured_outputs={"json": json.dumps(SCHEMA)}), ("json_schema", SCHEMA)),
        (chat(structured_outputs={"regex": "[a-z]+"}), ("regex", "[a-z]+")),
        (chat(structured_outputs={"choice": ["yes", "no"]}), ("choice", ["yes", "no"])),
        (chat(structured_outputs={"grammar": "start: \"a\""}), ("grammar", "start: \"a\"")),
        (chat(structured_outputs={"json_object": True}), ("json_object", True)),
        (chat(guided_json=SCHEMA), ("json_schema", SCHEMA)),
        (chat(guided_regex="\\d+"), ("regex", "\\d+")),
        (chat(guided_choice=["a", "b"]), ("choice", ["a", "b"])),
        (chat(guided_grammar="root ::= \"a\""), ("grammar", "root ::= \"a\"")),
        (chat(regex="x|y"), ("regex", "x|y")),
        (chat(json_schema=json.dumps(SCHEMA)), ("json_schema", SCHEMA)),
        (chat(ebnf="root ::= \"a\""), ("grammar", "root ::= \"a\"")),
        (chat(response_format={"type": "text"}), (None, None)),
    ]
    responses = post(fake, tiny_llama, "/v1/chat/completions", [b for b, _ in cases])
    assert [r.status_code for r in responses] == [200] * len(cases), [r.text for r in responses]
    for req, (_, (kind, value)) in zip(fake.requests, cases, strict=True):
        s = req.sampling.structured
        assert s.WhichOneof("kind") == kind
        if kind == "json_schema":
            assert json.loads(s.json_schema) == value
        elif kind == "choice":
            assert list(s.choice.choices) == value
        elif kind is not None:
            assert getattr(s, kind) == value
    assert fake.requests[1].sampling.structured.strict and not fake.requests[2].sampling.structured.strict


def test_completions_take_them_too_on_every_choice(fake, tiny_llama):
    (r,) = post(fake, tiny_llama, "/v1/completions",
                [{"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 2,
                  "response_format": {"type": "json_object"}}])
    assert r.status_code == 200, r.text
    assert len(fake.requests) == 4 and all(q.sampling.structured.json_object for q in fake.requests)


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": [1, 2]}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice[1]"),
    ({"structured_outputs": {"grammar": "  "}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_json": {"properties": {"a": {"type": 3}}}}, "guided_json"),
    ({"guided_regex": "[z-a]"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
])
def test_bad_constraints_are_400s_naming_the_field_and_reach_no_worker(fake, tiny_llama, extra, param):
    (r,) = post(fake, tiny_llama, "/v1/chat/completions", [chat(**extra)])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert not fake.requests


def test_two_constraints_name_both_fields(fake, tiny_llama):
    (r,) = post(fake, tiny_llama, "/v1/chat/completions",
                [chat(response_format={"type": "json_object"}, guided_regex="a")])
    assert "response_format, guided_regex" in r.json()["error"]["message"]


def test_the_routers_invalid_argument_names_the_requests_field(tiny_llama):
    bodies = [chat(guided_grammar='root ::= "a"'),
              chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}),
              chat(tools=[{"type": "function", "function": {"name": "a"}},
                          {"type": "function", "function": {"name": "b", "parameters": SCHEMA}}],
                   tool_choice={"type": "function", "function": {"name": "b"}})]
    for body, router_param, param in [(bodies[0], "structured.grammar", "guided_grammar"),
                                      (bodies[1], "structured", "response_format.json_schema.schema"),
                                      (bodies[2], "structured.tool_calls.schemas[0]", "tools[1].function.parameters")]:
        # the router's messages start with its own name of the field (engine/structured/compile.py)
        with FakeRouter(failing(grpc.StatusCode.INVALID_ARGUMENT, f"{router_param}: the grammar does not compile",
                                router_param), models=MODELS) as fake:
            for stream in (False, True):
                (r,) = post(fake, tiny_llama, "/v1/chat/completions", [{**body, "stream": stream}])
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["param"] == param and err["message"].startswith(f"{param}: the grammar does not compile")


def test_a_worker_400_about_another_field_keeps_its_name(tiny_llama):
    with FakeRouter(failing(grpc.StatusCode.INVALID_ARGUMENT, "bad top_k", "top_k"), models=MODELS) as fake:
        (r,) = post(fake, tiny_llama, "/v1/chat/completions", [chat(guided_regex="a")])
    assert r.json()["error"]["param"] == "top_k"


@pytest.mark.parametrize("schema", [True, {}, SCHEMA, {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/a"}],
                                                        "$defs": {"a": {"type": ["string", "null"]}}},
                                    {"type": "array", "items": [{"type": "integer"}], "minItems": 1}])
def test_schema_shapes_that_pass(schema):
    check_schema(schema, "x")


@pytest.mark.parametrize(("schema", "says"), [
    ([], "got list"), ({"type": []}, "anyOf is empty"), ({"required": "a"}, "required"), ({"enum": []}, ""),
    ({"minLength": -1}, "minLength"), ({"properties": {"a": {"items": {"type": "float"}}}}, "float"),
    ({"anyOf": []}, "anyOf"), ({"allOf": [{"type": "string"}, 5]}, "object or boolean"), ({"$ref": 3}, ""),
])
def test_schema_problems_are_the_enforcing_librarys_verdict(schema, says):
    """The gateway judges a schema as llguidance (which enforces it) does, as the gRPC path does: a 400
    naming the request's field, with llguidance's reason."""
    with pytest.raises(APIError) as e:
        check_schema(schema, "response_format.json_schema.schema")
    assert e.value.param == "response_format.json_schema.schema" and says in e.value.message
    assert e.value.message.startswith("response_format.json_schema.schema")


def test_false_json_object_is_no_constraint():
    assert constraints(None, {"json_object": False}, {}) == []


def test_what_the_gateway_sends_compiles_in_the_engines_compiler(fake, tiny_llama):
    """The router's check (engine/structured/compile.py) accepts every spelling and both tool grammars."""
    from tandem.engine.structured.compile import validate_structured
    from tandem.services.common.convert import structured_from_pb

    tools = [{"type": "function", "function": {"name": "a", "parameters": SCHEMA}}, {"type": "function",
                                                                                    "function": {"name": "b"}}]
    bodies = [chat(response_format={"type": "json_object"}),
              chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                           "strict": True}}),
              chat(guided_regex="[a-z]+"), chat(guided_choice=["yes", "no (really)"]),
              chat(structured_outputs={"grammar": 'start: "a" | "b"'}), chat(ebnf='root ::= "a" | "b"'),
              chat(tools=tools, tool_choice="required"),
              chat(tools=tools, tool_choice={"type": "function", "function": {"name": "b"}})]
    responses = post(fake, tiny_llama, "/v1/chat/completions", bodies)
    assert [r.status_code for r in responses] == [200] * len(bodies)
    for req in fake.requests:
        validate_structured(structured_from_pb(req.sampling.structured))


def test_one_call_at_most_compiles(fake, tiny_llama):
    from tandem.engine.structured.compile import validate_structured
    from tandem.services.common.convert import structured_from_pb

    body = chat(tools=[{"type": "function", "function": {"name": "b"}}], tool_choice="required",
                parallel_tool_calls=False)
    assert post(fake, tiny_llama, "/v1/chat/completions", [body])[0].status_code == 200
    validate_structured(structured_from_pb(fake.requests[0].sampling.structured))


# (request fields, whether llguidance takes it): Python's `re` and llguidance's Rust regex disagree on
# the first two, which is why the gateway no longer judges them itself.
EDGES = [
    ({"guided_regex": r"\p{L}+"}, True),                       # Unicode class: Rust yes, Python re no
    ({"guided_regex": r"(?<=a)b"}, False),                     # look-behind: Python re yes, Rust no
    ({"guided_regex": "a{2,1}"}, False),
    ({"guided_regex": "[a-"}, False),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "float"}}}}, False),
    ({"guided_json": {"anyOf": []}}, False),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "o", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}}}}, False),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}}}}, True),
    ({"guided_grammar": 'root ::= "a" | "b"'}, True),
    ({"guided_grammar": "root ::= ???"}, False),
    ({"guided_choice": ["a.b", "(c)"]}, True),
]


def test_http_and_grpc_give_the_same_verdicts(fake, tiny_llama):
    """One dialect: each edge case is refused over HTTP (the gateway, before the router) exactly when the
    router refuses the same constraint sent over gRPC (services/router/validation.py)."""
    from tandem.engine.errors import InvalidRequest
    from tandem.services.router.validation import validate_request

    responses = post(fake, tiny_llama, "/v1/chat/completions", [chat(**extra) for extra, _ in EDGES])
    sent = iter(fake.requests)
    for (extra, ok), r in zip(EDGES, responses, strict=True):
        assert (r.status_code == 200) == ok, (extra, r.text)
        if not ok:
            assert r.json()["error"]["param"].split(".")[0] == next(iter(extra)), r.text
            so = constraints(extra.get("response_format"), None, {k: v for k, v in extra.items()
                                                                   if k != "response_format"})[0].structured
        else:
            so = next(sent).sampling.structured        # what the gateway sent the router
        req = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_tokens=2, structured=so))
        try:
            validate_request(req)
            grpc_ok = True
        except InvalidRequest as e:
            assert e.param.startswith("structured"), e
            grpc_ok = False
        assert grpc_ok == ok, extra
