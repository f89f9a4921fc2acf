"""The runtime LoRA endpoints exist only with --enable-lora-runtime-updating, and check their body
and the API key before anything reaches the router (here: nothing listens at its address)."""

from __future__ import annotations

import asyncio

from tests.services.gateway.conftest import gateway_client

ROUTER = "127.0.0.1:1"   # never called by these requests


def _run(**config) -> list[tuple[int, dict]]:
    async def body():
        out = []
        async with gateway_client(ROUTER, None, **config) as (client, _):
            auth = {"Authorization": "Bearer k"} if config.get("api_key") else {}
            for path, kw in [("/v1/load_lora_adapter", {"json": {"lora_name": "a"}}),
                             ("/v1/unload_lora_adapter", {"content": b"[1]"}),
                             ("/v1/unload_lora_adapter", {"json": {"lora_name": "a"}, "no_auth": True})]:
                headers = {} if kw.pop("no_auth", False) else auth
                r = await client.post(path, headers=headers, **kw)
                out.append((r.status_code, r.json().get("error", {})))
        return out
    return asyncio.run(body())


def test_off_by_default():
    assert [status for status, _ in _run()] == [404, 404, 404]


def test_body_and_key_are_checked_first():
    (load, _), (unload, _), (no_key, _) = out = _run(enable_lora_runtime_updating=True, api_key="k")
    assert (load, unload, no_key) == (400, 400, 401), out
    assert out[0][1]["param"] == "lora_path" and "JSON object" in out[1][1]["message"]
