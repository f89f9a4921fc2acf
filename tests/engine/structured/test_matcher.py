"""Per-request matchers on a real tokenizer (torch-free here): masks, drafts, rollback, dead ends,
and the tool-call grammar's language."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tandem.engine.errors import InvalidRequest
from tandem.engine.structured.matcher import GrammarBackend, bitmask_words
from tandem.engine.structured_output import Kind, StructuredSpec, ToolCallSpec


@pytest.fixture(scope="module")
def backend(smollm2_path):
    return GrammarBackend(smollm2_path / "tokenizer.json", [2], 49152)


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(smollm2_path / "tokenizer.json"))


def allowed(g, vocab=49152) -> set[int]:
    row = np.zeros(bitmask_words(vocab), dtype=np.int32)
    g.fill(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


def walk(backend, tok, spec, text) -> tuple[int, object]:
    g = backend.matcher(spec)
    ids = tok.encode(text, add_special_tokens=False).ids
    return g.consume(ids), g, len(ids)


def test_choice_masks_and_eos_only_when_complete(backend, tok):
    g = backend.matcher(StructuredSpec(Kind.CHOICE, ("yes", "no")))
    first = allowed(g)
    assert tok.token_to_id("yes") in first and tok.token_to_id("no") in first and 2 not in first
    assert g.consume([tok.token_to_id("yes")]) == 1
    assert allowed(g) == {2}                    # only EOS: the value is complete
    assert g.consume([2]) == 1 and g.complete and not g.dead


def test_drafts_are_checked_and_rolled_back(backend, tok):
    g = backend.matcher(StructuredSpec(Kind.REGEX, "[0-9]{3}-[a-z]{2}"))
    ids = tok.encode("123-ab", add_special_tokens=False).ids
    bad = tok.encode("12x", add_special_tokens=False).ids
    assert g.accepts(ids) == len(ids)
    assert g.accepts(bad) < len(bad)
    before = allowed(g)
    assert g.consume(ids[:2]) == 2
    g.rollback(2)
    assert allowed(g) == before and g.num_tokens == 0


def test_tokens_after_a_complete_value_are_not_output_and_not_a_dead_end(backend, tok):
    """Speculation may accept drafts past the value's end (CI caught a complete tool call ending as
    grammar_dead_end): the value stays complete, the extra tokens are not taken."""
    g = backend.matcher(StructuredSpec(Kind.CHOICE, ("yes", "no")))
    yes, extra = tok.token_to_id("yes"), tok.encode(" and more", add_special_tokens=False).ids
    assert g.consume([yes, 2, *extra]) == 2
    assert g.complete and not g.dead and g.num_tokens == 2


def test_refused_token_is_a_dead_end(backend, tok):
    g = backend.matcher(StructuredSpec(Kind.REGEX, "[0-9]+"))
    assert g.consume(tok.encode("x", add_special_tokens=False).ids) == 0
    assert g.dead and not g.complete


def test_grammar_that_cannot_finish_is_dead_after_its_prefix(backend, tok):
    g = backend.matcher(StructuredSpec(Kind.GRAMMAR, 'start: "a" b\nb: b "c"\n'))
    assert g.consume([tok.token_to_id("a")]) == 1
    row = np.zeros(bitmask_words(49152), dtype=np.int32)
    assert not g.fill(row) and g.dead


def test_empty_language_is_refused_at_admission(backend):
    with pytest.raises(InvalidRequest):
        backend.matcher(StructuredSpec(Kind.GRAMMAR, 'start: b\nb: b "c"\n'))


def test_tool_calls_language(backend, tok):
    weather = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}, "required": ["name", "arguments"], "additionalProperties": False}
    spec = StructuredSpec(Kind.TOOL_CALLS, ToolCallSpec("<tool_call>\n", "\n</tool_call>", "\n",
                                                        (json.dumps(weather),), min_calls=1, max_calls=2))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for text, ok in ((call, True), (call + "\n" + call, True), (call + "\n" + call + "\n" + call, False),
                     (call.replace("get_weather", "get_time"), False), (call.replace('"city"', '"town"'), False)):
        took, g, n = walk(backend, tok, spec, text)
        assert (took == n and 2 in allowed(g)) == ok, text


def test_prototypes_are_copied_not_shared(backend, tok):
    spec = StructuredSpec(Kind.CHOICE, ("alpha", "beta"))
    a, b = backend.matcher(spec), backend.matcher(spec)
    a.consume(tok.encode("alpha", add_special_tokens=False).ids)
    assert 2 in allowed(a) and 2 not in allowed(b)


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "address": {"type": "object", "properties": {"city": {"type": "string"}}}},
          "required": ["name", "age"]}


def accepts(backend, tok, spec, text) -> bool:
    taken, g, n = walk(backend, tok, spec, text)
    return taken == n and g.complete


@pytest.mark.parametrize("strict", [False, True])
def test_objects_are_closed_unless_the_schema_opens_them(backend, tok, strict):
    spec = StructuredSpec.json_schema(PERSON, strict)
    assert accepts(backend, tok, spec, '{"name": "Ann", "age": 3, "address": {"city": "Oslo"}}')
    assert not accepts(backend, tok, spec, '{"name": "Ann", "age": 3, "country": "NO"}')
    assert not accepts(backend, tok, spec, '{"name": "Ann", "age": 3, "address": {"city": "Oslo", "zip": "1"}}')
    opened = {**PERSON, "additionalProperties": {"type": "string"}}
    if strict:
        with pytest.raises(InvalidRequest, match="strict mode needs closed objects"):
            backend.matcher(StructuredSpec.json_schema(opened, True))
    else:
        assert accepts(backend, tok, StructuredSpec.json_schema(opened), '{"name": "A", "age": 1, "x": "y"}')


def test_json_whitespace_compact_or_the_models_own_bounded(backend, tok, smollm2_path):
    spec = StructuredSpec.json_schema(PERSON, True)
    pretty = json.dumps({"name": "Ann", "age": 3, "address": {"city": "Oslo"}}, indent=2)
    assert accepts(backend, tok, spec, '{"name": "Ann", "age": 3}')       # compact: the default
    assert not accepts(backend, tok, spec, pretty)
    free = GrammarBackend(smollm2_path / "tokenizer.json", [2], 49152, compact=False)   # --enable-any-whitespace
    assert accepts(free, tok, spec, pretty)
    assert accepts(free, tok, spec, '{"name":"Ann","age":3}')
    assert not accepts(free, tok, spec, '{\n\n  "name": "Ann", "age": 3}')          # no blank lines
    assert not accepts(free, tok, spec, '{' + " " * 40 + '"name": "Ann", "age": 3}')  # no runs of spaces


@pytest.mark.parametrize("kind", [Kind.JSON_SCHEMA, Kind.CHOICE])
def test_a_thinking_model_thinks_freely_then_the_constraint_holds(backend, tok, kind):
    """--reasoning-parser qwen3: an optional <think> ... </think> (anything, newlines, braces, even a
    stray "<think>") before the constrained value; deepseek_r1: the prompt opened the thinking, so the
    output thinks up to </think> first. After </think> only the constraint; without the reasoning
    format the thinking itself is refused."""
    value, other = ('{"name": "Ada", "age": 36}', '{"name": "Ada"}') if kind is Kind.JSON_SCHEMA else ("yes", "maybe")
    base = StructuredSpec.json_schema(PERSON) if kind is Kind.JSON_SCHEMA else StructuredSpec(Kind.CHOICE, ("yes", "no"))
    qwen3 = StructuredSpec(base.kind, base.value, base.strict, reasoning="qwen3")
    r1 = StructuredSpec(base.kind, base.value, base.strict, reasoning="deepseek_r1")
    thought = 'Ada is 36 {not json} <think> and\nsays "hi".'
    assert accepts(backend, tok, qwen3, f"<think>{thought}</think>\n\n{value}")
    assert accepts(backend, tok, qwen3, value)                                # thinking off
    assert not accepts(backend, tok, qwen3, f"<think>{thought}</think>\n{other}")
    assert not accepts(backend, tok, qwen3, f"Sure! {value}")                 # no free text outside the thinking
    assert accepts(backend, tok, r1, f"{thought}</think>{value}")
    assert accepts(backend, tok, r1, f"<think>{thought}</think> {value}")
    assert not accepts(backend, tok, r1, f"{thought}</think>{other}")
    assert not accepts(backend, tok, base, f"<think>{thought}</think>{value}")
    assert qwen3.key != base.key != r1.key
    with pytest.raises(InvalidRequest, match="structured.reasoning"):
        backend.matcher(StructuredSpec(base.kind, base.value, reasoning="o1"))
