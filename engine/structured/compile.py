"""Structured-output constraints -> llguidance grammars, checked without a tokenizer (torch-free).

`compile_grammar(spec)` is what the router calls before any worker is touched and what every worker
compiles from: it builds the grammar text in llguidance's grammar language, validates it (a JSON
Schema llguidance cannot read, a keyword it cannot enforce under `strict`, a regex or grammar that
does not parse) and raises InvalidRequest naming the field; results are cached by the constraint's
canonical spelling (LRU, errors too). Only the tokenizer-bound half (engine/structured/matcher.py)
runs on workers.

JSON whitespace: `compact` (the default, `--disable-any-whitespace`) allows none but json.dumps'
separators (", ", ": "); else (`--enable-any-whitespace`) it follows the model, bounded: between any
two JSON tokens nothing, one space, or one newline and up to `MAX_INDENT` spaces or tabs, so a model
trained to pretty-print can, and none can pad with blank lines or runs of spaces. Measured on
SmolLM2 with closed objects, compact ends more answers by itself (docs/benchmarks.md).

Objects are closed unless the schema says otherwise: an object schema without `additionalProperties`
(or `patternProperties` / `unevaluatedProperties`) gets `"additionalProperties": false`, as vLLM's
default backend treats it, so the model never writes a key the schema does not name. Under `strict`
(OpenAI's strict mode) an object the schema leaves open explicitly is an error that names it; a
property left out of `required` stays optional (vLLM's reading; OpenAI would refuse the schema).
Members of `allOf` are left as written (closing each would refuse the keys of the others).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance

from tandem.engine.errors import InvalidRequest
from tandem.engine.structured_output import REASONING_FORMATS, Kind, StructuredSpec, ToolCallSpec

MAX_SPEC_CHARS = 256 * 1024        # a schema / grammar / regex / choice list, as text
MAX_CHOICES = 1024
CACHE_SIZE = 512

MAX_INDENT = 32                   # spaces/tabs after a newline between two JSON tokens
# llguidance's JSON compiler options; `lenient` (not strict) ignores keywords it cannot enforce.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_FLEXIBLE = {"whitespace_flexible": True, "item_separator": ",", "key_separator": ":",
             "whitespace_pattern": f"(\\x20|\\n[\\x20\\x09]{{0,{MAX_INDENT}}})"}
# Keywords whose value is a schema, a list of schemas, or an object of schemas (JSON Schema 2020-12).
_ONE_SCHEMA = ("additionalProperties", "additionalItems", "items", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LIST = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_ANY_OBJECT = '{"type": "object"}'
# Rust-regex metacharacters (escaped in choices).
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def compile_grammar(spec: StructuredSpec, compact: bool = True) -> str:
    """The llguidance grammar for `spec` (cached), JSON `compact` or with bounded free whitespace.
    Raises InvalidRequest with `param` naming the field in the public API's spelling
    (`structured.json_schema`, `structured.tool_calls.schemas[1]`, ...)."""
    return _CACHE.get(spec, compact)


def validate_structured(spec: StructuredSpec | None) -> None:
    """Raise InvalidRequest if `spec` cannot be enforced (no-op for None)."""
    if spec is not None:
        compile_grammar(spec)


def _build(spec: StructuredSpec, compact: bool) -> str:
    grammar = _build_value(spec, compact)
    return _after_thinking(grammar, spec.reasoning) if spec.reasoning else grammar


def _after_thinking(grammar: str, reasoning: str) -> str:
    """`grammar` preceded by a thinking model's free thinking, as its reasoning format opens it (the
    gateway's --reasoning-parser): qwen3 may open with `<think>` ... `</think>` (thinking off: it
    does not), deepseek_r1's prompt opened the thinking, so the output thinks up to `</think>` (a
    leading `<think>` allowed). The thinking is one lazy lexeme, ended by the first `</think>`; the
    constraint's own grammar, from the whitespace after it, is a sub-grammar (llguidance `@answer`).
    Literal text: in both families `<think>` and `</think>` are added tokens that are not special."""
    if reasoning not in REASONING_FORMATS:
        raise InvalidRequest(f"structured.reasoning must be one of {', '.join(REASONING_FORMATS)}, "
                             f"got {reasoning!r}", "structured.reasoning")
    inner = json.loads(grammar)["grammars"]
    inner[0] = {**inner[0], "name": "answer"}
    if reasoning == "qwen3":
        lines = ["start: think? answer", 'think: "<think>" thought']
    else:
        lines = ['start: "<think>"? thought answer']
    lark = "\n".join([*lines, r"thought[lazy]: /(?s:.*)<\/think>/", r"answer: /[ \t\n]*/ @answer"]) + "\n"
    return _checked(json.dumps({"grammars": [{"name": "main", "lark_grammar": lark}, *inner]}),
                    "structured.reasoning", "thinking format")


def _build_value(spec: StructuredSpec, compact: bool) -> str:
    kind, v = spec.kind, spec.value
    if kind is Kind.JSON_SCHEMA:
        param = "structured.json_schema"
        schema = close_objects(_json_schema(v, param), spec.strict, param)
        if isinstance(schema, bool):    # options apply to an object schema only
            schema = {} if schema else {"not": {}}
        text = json.dumps(schema)
        return _checked(llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_options(spec.strict, compact)),
                        param, "JSON Schema")
    if kind is Kind.JSON_OBJECT:
        return _checked(llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=_options(False, compact)),
                        "structured.json_object", "JSON object")
    if kind is Kind.REGEX:
        if not isinstance(v, str) or not v:
            raise InvalidRequest("structured.regex is empty", "structured.regex")
        _check_size(v, "structured.regex")
        return _checked(llguidance.LLMatcher.grammar_from_regex(v), "structured.regex", "regex")
    if kind is Kind.CHOICE:
        choices = tuple(v or ())
        if not choices:
            raise InvalidRequest("structured.choice needs at least one string", "structured.choice")
        if len(choices) > MAX_CHOICES:
            raise InvalidRequest(f"structured.choice has {len(choices)} strings; at most {MAX_CHOICES}",
                                 "structured.choice")
        if any(not isinstance(c, str) or not c for c in choices):
            raise InvalidRequest("structured.choice strings must be non-empty", "structured.choice")
        _check_size("".join(choices), "structured.choice")
        regex = "(" + "|".join("".join("\\" + ch if ch in _REGEX_META else ch for ch in c) for c in choices) + ")"
        return _checked(llguidance.LLMatcher.grammar_from_regex(regex), "structured.choice", "choice list")
    if kind is Kind.GRAMMAR:
        if not isinstance(v, str) or not v.strip():
            raise InvalidRequest("structured.grammar is empty", "structured.grammar")
        _check_size(v, "structured.grammar")
        return _checked(llguidance.LLMatcher.grammar_from_lark(_to_lark(v)), "structured.grammar", "grammar")
    if kind is Kind.TOOL_CALLS:
        assert isinstance(v, ToolCallSpec)
        return _checked(llguidance.LLMatcher.grammar_from_lark(_tool_calls_lark(v, spec.strict, compact)),
                        "structured.tool_calls", "tool-call format")
    raise AssertionError(f"unknown kind {kind}")


def _options(strict: bool, compact: bool) -> dict:
    return {**(_COMPACT if compact else _FLEXIBLE), "lenient": not strict}


def close_objects(schema, strict: bool, param: str, at: str = ""):
    """`schema` with every object schema that leaves its extra keys unsaid closed (see the module
    docstring); under `strict` an explicitly open one raises InvalidRequest naming where it is."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    types = out.get("type")
    is_object = types == "object" or (isinstance(types, list) and "object" in types) or "properties" in out
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if is_object and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    elif is_object and strict and out.get("additionalProperties", False) is not False:
        raise InvalidRequest(f"{param}: strict mode needs closed objects, but {at or 'the schema'} sets "
                             "additionalProperties (leave it out, or set it to false)", param)
    elif is_object and strict and ("patternProperties" in out or "unevaluatedProperties" in out):
        raise InvalidRequest(f"{param}: strict mode needs closed objects, but {at or 'the schema'} sets "
                             "patternProperties or unevaluatedProperties", param)
    here = at + "." if at else ""
    for key in _ONE_SCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key], strict, param, f"{here}{key}")
        elif key == "items" and isinstance(out.get(key), list):
            out[key] = [close_objects(s, strict, param, f"{here}items[{i}]") for i, s in enumerate(out[key])]
    for key in _SCHEMA_LIST:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s, strict, param, f"{here}{key}[{i}]") for i, s in enumerate(out[key])]
    for key in _SCHEMA_MAP:
        if isinstance(out.get(key), dict):
            out[key] = {n: close_objects(s, strict, param, f"{here}{key}.{n}") for n, s in out[key].items()}
    return out


def _json_schema(v, param: str) -> dict | bool:
    if not isinstance(v, str) or not v.strip():
        raise InvalidRequest(f"{param} is empty", param)
    _check_size(v, param)
    try:
        schema = json.loads(v)
    except ValueError as e:
        raise InvalidRequest(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequest(f"{param} must be a JSON object (a JSON Schema), got {type(schema).__name__}", param)
    return schema


def _tool_calls_lark(t: ToolCallSpec, strict: bool, compact: bool) -> str:
    """`begin` call `end` repeated min..max times with `separator` between; the call is a JSON value
    matching one of the schemas (each embedded with %json and its compile options)."""
    if not t.begin:
        raise InvalidRequest("structured.tool_calls.begin is empty", "structured.tool_calls.begin")
    if not t.schemas:
        raise InvalidRequest("structured.tool_calls needs at least one schema", "structured.tool_calls.schemas")
    if t.min_calls < 1:
        raise InvalidRequest(f"structured.tool_calls.min_calls must be >= 1, got {t.min_calls}",
                             "structured.tool_calls.min_calls")
    if t.max_calls and t.max_calls < t.min_calls:
        raise InvalidRequest(f"structured.tool_calls.max_calls ({t.max_calls}) is below min_calls ({t.min_calls})",
                             "structured.tool_calls.max_calls")
    alts = []
    for i, text in enumerate(t.schemas):
        param = f"structured.tool_calls.schemas[{i}]"
        schema = _json_schema(text, param)
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        schema = close_objects(schema, strict, param)
        schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **_options(strict, compact)}}
        # Checked one by one so that the error names the schema.
        _checked(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)), param, "JSON Schema")
        alts.append(f"fn{i}: %json {json.dumps(schema)}")
    sep = _lit(t.separator) + " " if t.separator else ""
    if t.max_calls == 1:   # exactly one call (Lark refuses an empty range {0,0})
        start = "start: call"
    else:
        start = f"start: call ({sep}call){{{t.min_calls - 1},{t.max_calls - 1 if t.max_calls else ''}}}"
    lines = [start,
             f"call: {_lit(t.begin)} args {_lit(t.end) if t.end else ''}",
             "args: " + " | ".join(f"fn{i}" for i in range(len(t.schemas))), *alts]
    return "\n".join(lines) + "\n"


def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _to_lark(text: str) -> str:
    """A GBNF grammar (vLLM / llama.cpp's EBNF, `root ::= ...`) becomes Lark; Lark stays as it is."""
    if "::=" not in text:
        return text
    from llguidance.gbnf_to_lark import gbnf_to_lark
    try:
        return gbnf_to_lark(text)
    except Exception as e:   # the converter raises its own error types
        raise InvalidRequest(f"structured.grammar: not a valid GBNF grammar: {e}", "structured.grammar") from None


def _check_size(text: str, param: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidRequest(f"{param} has {len(text)} characters; at most {MAX_SPEC_CHARS}", param)


def _checked(grammar: str, param: str, what: str) -> str:
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequest(f"{param}: invalid {what}: {error.strip()}", param)
    return grammar


class _GrammarCache:
    """LRU of compiled grammars (and of the errors of bad ones) by the constraint's canonical key;
    shared by every thread of a process."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict[str, str | InvalidRequest] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, spec: StructuredSpec, compact: bool = True) -> str:
        key = f"{'compact' if compact else 'flexible'}|{spec.key}"
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
                self.hits += 1
        if item is None:
            try:
                item = _build(spec, compact)
            except InvalidRequest as e:
                item = e
            with self._lock:
                self.misses += 1
                self._items[key] = item
                while len(self._items) > self.size:
                    self._items.popitem(last=False)
        if isinstance(item, InvalidRequest):
            raise InvalidRequest(item.message, item.param)
        return item

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.hits = self.misses = 0


_CACHE = _GrammarCache(CACHE_SIZE)


def cache_info() -> tuple[int, int, int]:
    """(hits, misses, entries) of the process's grammar cache."""
    return _CACHE.hits, _CACHE.misses, len(_CACHE._items)


def clear_cache() -> None:
    _CACHE.clear()
