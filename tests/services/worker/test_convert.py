"""Engine outputs -> GenerateResponse, and how the gateway and the SDK read `stop_reason` back."""

from __future__ import annotations

import pytest
from tandem_client._convert import chunk_from_pb
from tandem_client._proto import generation_pb2 as sdk_pb

from tandem.engine.outputs import FinishReason, RequestOutput
from tandem.services.gateway.responses import stop_reason
from tandem.services.worker.convert import output_to_pb


@pytest.mark.parametrize(("matched", "field"), [
    (None, None),                              # the model's EOS
    ("\n\n", "matched_stop"),                  # a stop string
    ("", "matched_stop"),                      # set, even though empty
    (7, "matched_stop_token_id"),              # a stop_token_ids entry
    (0, "matched_stop_token_id"),              # token id 0 is still a token id, not "unset"
])
def test_stop_reason_travels_unchanged_to_gateway_and_sdk(matched, field):
    out = RequestOutput("r1", [5], "", finish_reason=FinishReason.STOP, matched_stop=matched)
    msg = output_to_pb(out)
    assert msg.WhichOneof("stop_reason") == field
    assert stop_reason(msg) == matched and type(stop_reason(msg)) is type(matched)
    chunk = chunk_from_pb(sdk_pb.GenerateResponse.FromString(msg.SerializeToString()))
    assert chunk.matched_stop == matched and type(chunk.matched_stop) is type(matched)
