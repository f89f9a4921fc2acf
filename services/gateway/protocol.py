"""OpenAI request bodies (pydantic) and their conversion to the router's wire types.

Parsing is the edge: a body that does not parse, or a value out of range, is an APIError 400 naming
the offending parameter. Sampling values are checked with the engine's own `SamplingParams.validate`
(torch-free), so the gateway rejects exactly what a worker would, before any worker is involved.
Output constraints (response_format and its vLLM/SGLang spellings, tools) are read in structured.py
and tools.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

from tandem.engine.errors import InvalidRequest
from tandem.engine.sampling_params import SamplingDefaults, SamplingParams
from tandem.engine.scheduler.queue_policy import check_priority
from tandem.services.gateway.errors import bad_request
from tandem.services.gateway.structured import Constraint, constraints, only_one
from tandem.services.gateway.tools import ToolUse, history_calls, parse_tool_use
from tandem.v1 import generation_pb2

SEED_MASK = (1 << 64) - 1
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's bound on `logprobs`
# OpenAI's message roles; anything else is a client error, not something to hand the chat template.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The sampling fields every generation API takes (the Responses and Messages APIs as extensions
    beyond their own); unknown fields are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool | None = None
    user: str | None = None
    priority: StrictInt | None = None  # SGLang's extension; strict: "3", 3.0 and true are 400s


class _Common(SamplingFields):
    """Fields both OpenAI completion endpoints share."""

    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # Output constraints (structured.py checks them): OpenAI's, vLLM's two spellings, SGLang's.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    regex: Any = None
    json_schema: Any = None
    ebnf: Any = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for this endpoint
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_Common):
    messages: list[Any]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None


def parse(model: type[BaseModel], body: bytes) -> Any:
    """Parse a JSON body; the first problem becomes a 400 naming its parameter."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise bad_request(f"the body is not valid JSON: {err['msg']}") from None
        param = _param_name(list(err["loc"]))
        raise bad_request(f"{param or 'body'}: {err['msg']}", param) from None


def _param_name(loc: list[Any]) -> str | None:
    # pydantic appends the union member it tried ('str', 'list[int]'); those are not parameters.
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif not any(ch in p for ch in "[]") and p not in ("str", "int", "float", "bool"):
            parts.append(("." if parts else "") + p)
    return "".join(parts) or None


@dataclass(frozen=True)
class Sampling:
    """A request's validated sampling settings; `to_pb(seed_offset)` makes one choice's wire params."""

    params: SamplingParams
    constraint: Constraint | None = field(default=None)

    def to_pb(self, seed_offset: int = 0) -> generation_pb2.SamplingParams:
        p = self.params
        # Every field set, the model's defaults already in: the worker has nothing left to fill (a
        # top_k of 0 would read as unset there; -1 is "off").
        pb = generation_pb2.SamplingParams(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else -1, min_p=p.min_p,
            repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty,
            presence_penalty=p.presence_penalty, max_tokens=p.max_tokens, stop=p.stop,
            stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos, logprobs=p.logprobs,
            top_logprobs=p.top_logprobs, skip_special_tokens=p.skip_special_tokens,
        )
        if self.constraint is not None:
            pb.structured.CopyFrom(self.constraint.structured)
        if p.seed is not None:
            # Choice i of a seeded request uses seed + i: reproducible, yet the n choices differ.
            pb.seed = (p.seed + seed_offset) & SEED_MASK
        return pb


def check_common(req: _Common, max_n: int) -> None:
    if not 1 <= req.n <= max_n:
        raise bad_request(f"n must be in [1, {max_n}], got {req.n}", "n")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    check_priority_field(req)


def check_priority_field(req: SamplingFields) -> None:
    if req.priority is not None:
        try:
            check_priority(req.priority)
        except ValueError as e:
            raise bad_request(str(e), "priority") from None


def make_sampling(req: SamplingFields, max_tokens: int, *, logprobs: bool, top_logprobs: int,
                  defaults: SamplingDefaults = SamplingDefaults(), max_tokens_param: str = "max_tokens",
                  constraint: Constraint | None = None) -> Sampling:
    """Build and validate the engine's SamplingParams, the fields the request leaves out taken from
    `defaults` (the model's); raises APIError 400 with the parameter's name."""
    try:
        params = defaults.fill(SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
        ))
        params.validate()
    except InvalidRequest as e:
        param = max_tokens_param if e.param == "max_tokens" else e.param
        raise bad_request(e.message.replace("max_tokens", max_tokens_param), param) from None
    return Sampling(params, constraint)


def output_constraint(req: _Common, tools: ToolUse | None = None) -> Constraint | None:
    """The request's one output constraint (or none); two or more are a 400 naming them."""
    flat = {name: getattr(req, name) for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                                  "regex", "json_schema", "ebnf")}
    found = constraints(req.response_format, req.structured_outputs, flat)
    if tools is not None and (c := tools.constraint()) is not None:
        found.append(c)
    return only_one(found)


def tool_use(req: ChatCompletionRequest) -> ToolUse | None:
    return parse_tool_use(req.tools, req.tool_choice, req.parallel_tool_calls)


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """`prompt` as a list of prompts: one string or token list, or a batch of either."""
    p = req.prompt
    prompts: list[str | list[int]]
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        prompts = [p]
    else:
        prompts = list(p)
    if not prompts or any(len(x) == 0 for x in prompts):
        raise bad_request("prompt must not be empty", "prompt")
    return prompts


def check_completion(req: CompletionRequest) -> None:
    if req.echo:
        raise bad_request("echo is not supported", "echo")
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (or be omitted)", "best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {req.logprobs}", "logprobs")


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template wants them: `content` a string (text parts joined), an assistant's
    `tool_calls` checked, with their arguments as objects."""
    if not req.messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(req.messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string `role`", f"messages[{i}].role")
        if m["role"] not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(repr(r) for r in CHAT_ROLES)}; "
                              f"got {m['role']!r}", f"messages[{i}].role")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}].content: only text parts are supported",
                                      f"messages[{i}].content")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                              f"messages[{i}].content")
        msg = {**m, "content": content}
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = history_calls(m, i)
        out.append(msg)
    return out


def text_of(content: Any, at: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """Content given as a string or as a list of text parts (`{"type": one of kinds, "text": ...}`),
    joined by newlines; anything else is a 400 naming the part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{at} must be a string or a list of text parts", at)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise bad_request(f"{at}[{j}]: only {' / '.join(kinds)} parts are supported, got {kind!r}", f"{at}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)
