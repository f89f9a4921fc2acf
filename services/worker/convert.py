"""Engine outputs -> wire types for workers (requests are converted in services/common/convert.py)."""

from __future__ import annotations

from tandem.engine.outputs import FinishReason, RequestOutput
from tandem.engine.scheduler.step_cost import StepCostModel
from tandem.v1 import generation_pb2, worker_pb2

_FINISH = {
    None: generation_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.ABORT: generation_pb2.FINISH_REASON_ABORT,
    FinishReason.GRAMMAR_DEAD_END: generation_pb2.FINISH_REASON_GRAMMAR_DEAD_END,
}


def output_to_pb(out: RequestOutput, convert_tokens=None) -> generation_pb2.GenerateResponse:
    resp = generation_pb2.GenerateResponse(
        request_id=out.rid, token_ids=out.token_ids, text=out.text, finish_reason=_FINISH[out.finish_reason],
    )
    if isinstance(out.matched_stop, str):
        resp.matched_stop = out.matched_stop
    elif out.matched_stop is not None:
        resp.matched_stop_token_id = out.matched_stop
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


def step_cost_to_pb(cost: StepCostModel) -> worker_pb2.StepCost | None:
    """The scheduler's fitted step costs for the worker's load (None, the field unset, before a fit)."""
    fit = cost.fit()
    if fit is None:
        return None
    a, b, c = fit
    return worker_pb2.StepCost(base_s=a, per_decode_row_s=b, per_prefill_token_s=c, steps=cost.steps)
