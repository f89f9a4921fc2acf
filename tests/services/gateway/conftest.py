"""A gateway app in this process, in front of a FakeRouter (tests/sdk/fake_router.py)."""

from __future__ import annotations

import contextlib
import json

import httpx

from tandem.services.gateway.app import Gateway, create_app
from tandem.services.gateway.config import GatewayConfig
from tandem.v1 import generation_pb2 as pb

MODEL = "tiny"
CONTEXT = 64
MODELS = (pb.ModelInfo(id=MODEL, max_context_len=CONTEXT, vocab_size=512),)


@contextlib.asynccontextmanager
async def gateway_client(router_addr: str, tokenizer: str, **config):
    gw = Gateway(GatewayConfig(router=router_addr, tokenizer=tokenizer, **config))
    try:
        transport = httpx.ASGITransport(app=create_app(gw))
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            yield client, gw
    finally:
        await gw.close()


def sse_events(body: str) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded ("[DONE]" stays a string)."""
    out = []
    for block in body.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
