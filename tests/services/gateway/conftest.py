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


@contextlib.asynccontextmanager
async def official_clients(router_addr: str, tokenizer: str, api_key: str = "sk-test", **config):
    """The official `openai` and `anthropic` clients (async) on a gateway app in this process:
    (openai, anthropic, gateway)."""
    import anthropic
    import httpx2
    import openai

    gw = Gateway(GatewayConfig(router=router_addr, tokenizer=tokenizer, api_key=api_key, **config))
    app = create_app(gw)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as h1, \
                httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gateway") as h2:
            yield (openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=api_key, http_client=h1, max_retries=0),
                   anthropic.AsyncAnthropic(base_url="http://gateway", api_key=api_key, http_client=h2,
                                            max_retries=0),
                   gw)
    finally:
        await gw.close()


def scripted(text: str, reason: int = pb.FINISH_REASON_STOP, step: int = 3, matched_stop: str = ""):
    """A FakeRouter handler that answers every request with `text`, `step` characters a chunk."""
    from tests.sdk.fake_router import prompt_len

    def handler(req, _context):
        pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
        for i, piece in enumerate(pieces):
            msg = pb.GenerateResponse(request_id=req.request_id, token_ids=[300 + i], text=piece)
            if i == len(pieces) - 1:
                msg.finish_reason = reason
                if matched_stop:
                    msg.matched_stop = matched_stop
                msg.usage.CopyFrom(pb.Usage(prompt_tokens=prompt_len(req), completion_tokens=len(pieces)))
            yield msg

    return handler
