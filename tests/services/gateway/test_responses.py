"""OpenAI response shapes built from GenerateResponse messages (no server)."""

from __future__ import annotations

import pytest

from tandem.services.gateway.responses import ChatFormat, Choice, CompletionFormat
from tandem.v1 import generation_pb2 as pb

STOP, LENGTH = pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH


@pytest.mark.parametrize(("last", "finish", "reason"), [
    (pb.GenerateResponse(text="b", finish_reason=STOP), "stop", None),                          # EOS
    (pb.GenerateResponse(text="b", finish_reason=STOP, matched_stop="\n"), "stop", "\n"),
    (pb.GenerateResponse(text="b", finish_reason=STOP, matched_stop_token_id=2), "stop", 2),
    (pb.GenerateResponse(text="b", finish_reason=LENGTH), "length", None),
])
@pytest.mark.parametrize("fmt", [CompletionFormat, ChatFormat])
def test_stop_reason_follows_vllm(fmt, last, finish, reason):
    f = fmt("id", 0, "m", None, None)
    first = pb.GenerateResponse(text="a")
    assert "stop_reason" not in f.chunk(0, first, False)["choices"][0]
    end = f.chunk(0, last, False)["choices"][0]
    assert (end["finish_reason"], end["stop_reason"]) == (finish, reason)
    choice = Choice(0, 1)
    choice.add(first)
    choice.add(last)
    [body] = f.response([choice], 1)["choices"]
    assert (body["finish_reason"], body["stop_reason"]) == (finish, reason)
