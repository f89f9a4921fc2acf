"""The SDK's dataclasses <-> tandem.v1 protobuf messages (the only place they meet)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tandem_client._proto import generation_pb2 as pb
from tandem_client.structured import Choice, Grammar, JsonObject, JsonSchema, Regex, Structured, ToolCalls
from tandem_client.types import (
    FinishReason,
    ModelInfo,
    SamplingParams,
    StreamChunk,
    TokenLogprob,
    TopLogprob,
    Usage,
)

GENERATE = "/tandem.v1.Generation/Generate"
LIST_MODELS = "/tandem.v1.Generation/ListModels"
_SEED_MASK = (1 << 64) - 1
_FINISH = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_STOP: FinishReason.STOP,
    pb.FINISH_REASON_ABORT: FinishReason.ABORT,
    pb.FINISH_REASON_GRAMMAR_DEAD_END: FinishReason.GRAMMAR_DEAD_END,
}

Prompt = str | Sequence[int]


def merge_params(params: SamplingParams | None, overrides: dict) -> SamplingParams:
    """`params` (or the defaults) with keyword overrides; an unknown keyword is a TypeError."""
    params = params if params is not None else SamplingParams()
    return dataclasses.replace(params, **overrides) if overrides else params


def params_to_pb(p: SamplingParams) -> pb.SamplingParams:
    if isinstance(p.stop, str):
        raise TypeError("stop must be a sequence of strings, not one string: use stop=[...]")
    # Unset (None) fields stay unset on the wire: the server fills the model's defaults.
    optional = {k: v for k, v in (("temperature", p.temperature), ("top_p", p.top_p), ("top_k", p.top_k),
                                  ("min_p", p.min_p), ("repetition_penalty", p.repetition_penalty))
                if v is not None}
    out = pb.SamplingParams(
        **optional, frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty, max_tokens=p.max_tokens, stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos, logprobs=p.logprobs,
        top_logprobs=p.top_logprobs, skip_special_tokens=p.skip_special_tokens,
    )
    if p.seed is not None:
        out.seed = p.seed & _SEED_MASK
    if p.structured is not None:
        out.structured.CopyFrom(structured_to_pb(p.structured))
    return out


def structured_to_pb(s: Structured) -> pb.StructuredOutput:
    if isinstance(s, JsonSchema):
        return pb.StructuredOutput(json_schema=s.text, strict=s.strict)
    if isinstance(s, JsonObject):
        return pb.StructuredOutput(json_object=True)
    if isinstance(s, Regex):
        return pb.StructuredOutput(regex=s.pattern)
    if isinstance(s, Choice):
        if isinstance(s.options, str):
            raise TypeError("Choice takes a sequence of strings, not one string: Choice([...])")
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=list(s.options)))
    if isinstance(s, Grammar):
        return pb.StructuredOutput(grammar=s.grammar)
    if isinstance(s, ToolCalls):
        return pb.StructuredOutput(tool_calls=pb.ToolCallFormat(
            begin=s.begin, end=s.end, separator=s.separator, schemas=[t.call_schema() for t in s.tools],
            min_calls=s.min_calls, max_calls=s.max_calls))
    raise TypeError(f"structured must be JsonSchema, JsonObject, Regex, Choice, Grammar or ToolCalls, "
                    f"got {type(s).__name__}")


def build_request(prompt: Prompt, params: SamplingParams, model: str, request_id: str,
                  priority: int = 0) -> pb.GenerateRequest:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"priority must be an int, got {type(priority).__name__}")
    # The server checks the range (an int32) and answers INVALID_ARGUMENT; int64 on the wire.
    req = pb.GenerateRequest(request_id=request_id, model=model, sampling=params_to_pb(params), priority=priority)
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        req.token_ids.ids.extend(prompt)
    else:
        raise TypeError(f"prompt must be a string or a sequence of token ids, got {type(prompt).__name__}")
    return req


def _stop_reason(msg: pb.GenerateResponse) -> str | int | None:
    which = msg.WhichOneof("stop_reason")
    return None if which is None else getattr(msg, which)


def chunk_from_pb(msg: pb.GenerateResponse) -> StreamChunk:
    usage = None
    if msg.HasField("usage"):
        u = msg.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
    logprobs = tuple(
        TokenLogprob(lp.token_id, lp.logprob, tuple(TopLogprob(t.token_id, t.logprob, t.token) for t in lp.top))
        for lp in msg.logprobs
    )
    return StreamChunk(
        request_id=msg.request_id, text=msg.text, token_ids=tuple(msg.token_ids), logprobs=logprobs,
        finish_reason=_FINISH.get(msg.finish_reason), matched_stop=_stop_reason(msg), usage=usage,
    )


def models_from_pb(resp: pb.ListModelsResponse) -> list[ModelInfo]:
    return [ModelInfo(m.id, m.max_context_len, m.vocab_size) for m in resp.models]
