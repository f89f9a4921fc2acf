"""Wire <-> domain conversions for workers: the only place protobuf meets engine types."""

from __future__ import annotations

from engine.detokenizer import FinishReason
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from tandem.v1 import generation_pb2


def sampling_from_pb(sp: generation_pb2.SamplingParams) -> SamplingParams:
    """Proto3 zeros mean "unset" where zero is not a meaningful value (top_p, repetition_penalty)."""
    return SamplingParams(
        max_tokens=sp.max_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p or 1.0,
        top_k=sp.top_k if sp.top_k > 0 else -1,
        min_p=sp.min_p,
        repetition_penalty=sp.repetition_penalty or 1.0,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        seed=sp.seed if sp.HasField("seed") else None,
        stop=tuple(sp.stop),
        stop_token_ids=tuple(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        logprobs=sp.logprobs or sp.top_logprobs > 0,
        top_logprobs=sp.top_logprobs,
        skip_special_tokens=sp.skip_special_tokens if sp.HasField("skip_special_tokens") else True,
    )


def prompt_from_pb(msg) -> str | list[int]:
    """The `prompt` oneof of a GenerateRequest / PrefillRequest / DecodeRequest."""
    which = msg.WhichOneof("prompt")
    if which == "text":
        return msg.text
    if which == "token_ids":
        return list(msg.token_ids.ids)
    return ""


_FINISH = {
    None: generation_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.ABORT: generation_pb2.FINISH_REASON_ABORT,
}


def output_to_pb(out: RequestOutput, convert_tokens=None) -> generation_pb2.GenerateResponse:
    resp = generation_pb2.GenerateResponse(
        request_id=out.rid, token_ids=out.token_ids, text=out.text, finish_reason=_FINISH[out.finish_reason],
    )
    if out.matched_stop is not None:
        resp.matched_stop = str(out.matched_stop)
    for lp in out.logprobs or ():
        names = convert_tokens([t for t, _ in lp.top]) if convert_tokens and lp.top else [""] * len(lp.top)
        resp.logprobs.append(generation_pb2.TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob,
            top=[generation_pb2.TopLogprob(token_id=t, logprob=v, token=n)
                 for (t, v), n in zip(lp.top, names, strict=True)],
        ))
    if out.usage is not None:
        resp.usage.CopyFrom(generation_pb2.Usage(
            prompt_tokens=out.usage.prompt_tokens, completion_tokens=out.usage.completion_tokens,
            cached_tokens=out.usage.cached_tokens,
        ))
    return resp
