"""The cheap checks the router makes before contacting any worker (workers validate fully, with the
tokenizer). Wire defaults are mapped to engine values here, so the checks are the engine's own."""

from __future__ import annotations

from tandem.engine.errors import InvalidRequest
from tandem.engine.structured.compile import validate_structured
from tandem.services.common.convert import priority_from_pb, sampling_from_pb
from tandem.services.common.limits import RequestLimits
from tandem.v1 import generation_pb2


def validate_request(req: generation_pb2.GenerateRequest, limits: RequestLimits = RequestLimits()) -> None:
    """Raise InvalidRequest (with `param`) for a request no worker could accept, or over `limits`."""
    if req.resume_ids:
        raise InvalidRequest("resume_ids is set by the router only (mid-stream migration)", "resume_ids")
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("a prompt is required: set text or token_ids", "prompt")
    if kind == "text" and not req.text:
        raise InvalidRequest("prompt is empty", "prompt")
    if kind == "token_ids" and not req.token_ids.ids:
        raise InvalidRequest("prompt token_ids is empty", "prompt")
    if kind == "token_ids":
        limits.check_prompt_tokens(len(req.token_ids.ids))
    sampling = sampling_from_pb(req.sampling)
    sampling.validate()
    validate_structured(sampling.structured)   # a schema / grammar that cannot be enforced: 400, no worker touched
    if req.sampling.max_tokens:                  # 0 on the wire: the worker's default, not the client's ask
        limits.check_max_tokens(sampling.max_tokens)
    limits.check_stop(sampling.stop)
    priority_from_pb(req)
