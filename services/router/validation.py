"""The cheap checks the router makes before contacting any worker (workers validate fully, with the
tokenizer). Wire defaults are mapped to engine values here, so the checks are the engine's own."""

from __future__ import annotations

from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams
from tandem.v1 import generation_pb2


def sampling_from_pb(pb: generation_pb2.SamplingParams) -> SamplingParams:
    """generation.proto's SamplingParams -> the engine's (0 = unset for top_p and repetition_penalty)."""
    return SamplingParams(
        max_tokens=pb.max_tokens,
        temperature=pb.temperature,
        top_p=pb.top_p or 1.0,
        top_k=pb.top_k if pb.top_k > 0 else -1,
        min_p=pb.min_p,
        repetition_penalty=pb.repetition_penalty or 1.0,
        frequency_penalty=pb.frequency_penalty,
        presence_penalty=pb.presence_penalty,
        seed=pb.seed if pb.HasField("seed") else None,
        stop=tuple(pb.stop),
        stop_token_ids=tuple(pb.stop_token_ids),
        ignore_eos=pb.ignore_eos,
        logprobs=pb.logprobs,
        top_logprobs=pb.top_logprobs,
        skip_special_tokens=pb.skip_special_tokens,
    )


def validate_request(req: generation_pb2.GenerateRequest) -> None:
    """Raise InvalidRequest (with `param`) for a request no worker could accept."""
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("a prompt is required: set text or token_ids", "prompt")
    if kind == "text" and not req.text:
        raise InvalidRequest("prompt is empty", "prompt")
    if kind == "token_ids" and not req.token_ids.ids:
        raise InvalidRequest("prompt token_ids is empty", "prompt")
    sampling_from_pb(req.sampling).validate()
