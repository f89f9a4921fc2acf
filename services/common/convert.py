"""Public-API wire types -> engine types (torch-free: the router uses it too)."""

from __future__ import annotations

from tandem.engine.errors import InvalidRequest
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.queue_policy import check_priority
from tandem.engine.structured_output import Kind, StructuredSpec, ToolCallSpec
from tandem.v1 import generation_pb2


def sampling_from_pb(sp: generation_pb2.SamplingParams) -> SamplingParams:
    """The sampling fields a model may recommend stay None when unset (or 0 where zero is not a
    meaningful value: top_p, top_k, repetition_penalty): the engine gives them the model's defaults
    (engine/sampling_params.py). A negative top_k turns top-k off. `skip_special_tokens` defaults to
    true when unset; asking for top_logprobs implies logprobs."""
    return SamplingParams(
        max_tokens=sp.max_tokens,
        temperature=sp.temperature if sp.HasField("temperature") else None,
        top_p=sp.top_p or None,
        top_k=None if sp.top_k == 0 else max(sp.top_k, -1),
        min_p=sp.min_p if sp.HasField("min_p") else None,
        repetition_penalty=sp.repetition_penalty or None,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        seed=sp.seed if sp.HasField("seed") else None,
        stop=tuple(sp.stop),
        stop_token_ids=tuple(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        logprobs=sp.logprobs or sp.top_logprobs > 0,
        top_logprobs=sp.top_logprobs,
        skip_special_tokens=sp.skip_special_tokens if sp.HasField("skip_special_tokens") else True,
        structured=structured_from_pb(sp.structured) if sp.HasField("structured") else None,
    )


def structured_from_pb(so: generation_pb2.StructuredOutput) -> StructuredSpec | None:
    """The `structured` field (None when no kind is set: free text). Not validated here
    (SamplingParams.validate compiles it)."""
    which = so.WhichOneof("kind")
    if which is None or (which == "json_object" and not so.json_object):
        return None
    kind = Kind(which)
    if kind is Kind.CHOICE:
        value = tuple(so.choice.choices)
    elif kind is Kind.TOOL_CALLS:
        t = so.tool_calls
        value = ToolCallSpec(t.begin, t.end, t.separator, tuple(t.schemas), t.min_calls, t.max_calls)
    elif kind is Kind.JSON_OBJECT:
        value = None
    else:
        value = getattr(so, which)
    return StructuredSpec(kind, value, so.strict, so.reasoning)


def structured_to_pb(spec: StructuredSpec) -> generation_pb2.StructuredOutput:
    """The inverse of `structured_from_pb` (the Python API and tests build wire requests with it)."""
    so = generation_pb2.StructuredOutput(strict=spec.strict, reasoning=spec.reasoning)
    if spec.kind is Kind.CHOICE:
        so.choice.choices.extend(spec.value)
    elif spec.kind is Kind.TOOL_CALLS:
        t = spec.value
        so.tool_calls.CopyFrom(generation_pb2.ToolCallFormat(
            begin=t.begin, end=t.end, separator=t.separator, schemas=list(t.schemas),
            min_calls=t.min_calls, max_calls=t.max_calls))
    elif spec.kind is Kind.JSON_OBJECT:
        so.json_object = True
    else:
        setattr(so, spec.kind.value, spec.value)
    return so


def prompt_from_pb(msg) -> str | list[int]:
    """The `prompt` oneof of a GenerateRequest / PrefillRequest / DecodeRequest ("" when unset)."""
    which = msg.WhichOneof("prompt")
    if which == "text":
        return msg.text
    if which == "token_ids":
        return list(msg.token_ids.ids)
    return ""


def priority_from_pb(msg) -> int:
    """The `priority` of a GenerateRequest / PrefillRequest / DecodeRequest. Raises InvalidRequest."""
    try:
        return check_priority(msg.priority)
    except ValueError as e:
        raise InvalidRequest(str(e), "priority") from None
