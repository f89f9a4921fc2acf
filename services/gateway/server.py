"""The gateway process: uvicorn (uvloop + httptools) serving the FastAPI app; lifecycle and READY line.

create (`Gateway` + app, socket bound) → start (tokenizers warmed, uvicorn serving, `TANDEM_READY`)
→ serve → drain on SIGTERM/SIGINT (uvicorn stops accepting and lets responses finish for up to
`drain_timeout_s`) → close (the router channel).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import socket
import sys

import uvicorn

from tandem.services.gateway.app import Gateway, create_app
from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.errors import APIError

log = logging.getLogger(__name__)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def serve(config: GatewayConfig) -> int:
    try:
        sock = bind(config.host, config.port)
    except OSError as e:
        print(f"error: gateway cannot listen on {config.http_addr}: {e}", file=sys.stderr, flush=True)
        return 1
    port = sock.getsockname()[1]
    gateway = Gateway(config)
    try:
        # Best effort: load the served models' tokenizers now, not on the first request.
        await asyncio.wait_for(gateway.catalog.models(), timeout=30)
    except (APIError, TimeoutError) as e:
        log.warning("no models from router %s yet (%s); will ask again on the first request", config.router, e)
    server = uvicorn.Server(uvicorn.Config(
        create_app(gateway), http="httptools", lifespan="off", log_level="warning", access_log=False,
        timeout_graceful_shutdown=config.drain_timeout_s, timeout_keep_alive=30,
    ))
    # uvicorn re-raises the signal that stopped it once it has shut down; with these handlers that is a
    # no-op instead of the default action (death before the router channel is closed).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started:
        host = f"[{config.host}]" if ":" in config.host else config.host
        url = f"http://{host}:{port}"
        print("TANDEM_READY " + json.dumps({"role": "gateway", "http_addr": f"{host}:{port}", "url": url,
                                            "router": config.router}), flush=True)
        log.info("gateway on %s -> router %s", url, config.router)
    try:
        await task
    finally:
        await gateway.close()
        sock.close()
    return 0 if server.started else 1


def run(args: argparse.Namespace) -> int:
    try:
        config = GatewayConfig.from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:  # uvicorn[standard] brings it; plain asyncio works too
        return asyncio.run(serve(config))
    return uvloop.run(serve(config))
