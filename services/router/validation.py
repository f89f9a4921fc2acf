"""The cheap checks the router makes before contacting any worker (workers validate fully, with the
tokenizer). Wire defaults are mapped to engine values here, so the checks are the engine's own."""

from __future__ import annotations

from engine.errors import InvalidRequest
from services.common.convert import priority_from_pb, sampling_from_pb
from tandem.v1 import generation_pb2


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
    priority_from_pb(req)
