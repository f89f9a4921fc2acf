"""Runtime LoRA adapter updates over HTTP, vLLM's endpoints: `POST /v1/load_lora_adapter`
{"lora_name", "lora_path"} and `POST /v1/unload_lora_adapter` {"lora_name"}. Served only with
--enable-lora-runtime-updating (otherwise the paths do not exist: 404), with the API key when one is
set. The router applies them on every worker (services/router/lora_admin.py).

Answers: 200 with a line of text (as vLLM's); 400 for a malformed adapter or body, naming what is
wrong; 404 for unloading an adapter nobody has; 409 for unloading one that requests in flight use
(refused: retry once they finished); 403 when the workers do not allow runtime updates. `/v1/models`
shows the change on its next call (the model list is fetched again).
"""

from __future__ import annotations

import json

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from tandem.services.gateway.errors import APIError, bad_request
from tandem.v1 import generation_pb2, generation_pb2_grpc

ADMIN_TIMEOUT_S = 120.0


def add_lora_admin_routes(app: FastAPI, gateway) -> None:
    """Register the endpoints on `app` when `gateway.config.enable_lora_runtime_updating`."""
    if not gateway.config.enable_lora_runtime_updating:
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        gateway.authorize(request)
        body = await _body(request, ("lora_name", "lora_path"))
        msg = generation_pb2.LoadLoraAdapterRequest(lora_name=body["lora_name"], lora_path=body["lora_path"])
        await _call(gateway, "LoadLoraAdapter", msg)
        return PlainTextResponse(f"Success: LoRA adapter '{msg.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        gateway.authorize(request)
        body = await _body(request, ("lora_name",))
        await _call(gateway, "UnloadLoraAdapter", generation_pb2.UnloadLoraAdapterRequest(lora_name=body["lora_name"]))
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")


async def _body(request: Request, fields: tuple[str, ...]) -> dict[str, str]:
    try:
        body = json.loads(await request.body() or b"null")
    except ValueError as e:
        raise bad_request(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object with {', '.join(fields)}")
    for f in fields:
        if not isinstance(body.get(f), str) or not body[f].strip():
            raise bad_request(f"`{f}` is required: a non-empty string", f)
    return body


async def _call(gateway, method: str, msg) -> None:
    stub = generation_pb2_grpc.LoraAdminStub(gateway.router.channel)
    try:
        await getattr(stub, method)(msg, timeout=ADMIN_TIMEOUT_S)
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
            raise APIError(409, e.details() or "conflict", "lora_name", code="conflict") from None
        raise APIError.from_rpc(e) from None
    finally:
        gateway.catalog.invalidate()
