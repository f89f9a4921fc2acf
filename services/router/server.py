"""The router process: gRPC server (Generation + health + reflection), registry, metrics, lifecycle."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.services.common import keepalive
from tandem.services.common.registry import ROLE_NAMES, WorkerRegistry, create_registry
from tandem.services.router.channels import MAX_MESSAGE_BYTES, ChannelPool
from tandem.services.router.config import RouterConfig
from tandem.services.router.kv_feed import EventPrefixView, KVEventFeed
from tandem.services.router.lora_admin import RouterLoraAdmin
from tandem.services.router.metrics import RouterMetrics
from tandem.services.router.servicer import GenerationServicer
from tandem.v1 import generation_pb2, generation_pb2_grpc, worker_pb2

log = logging.getLogger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
PUBLIC_SERVICES = frozenset({GENERATION_SERVICE, reflection.SERVICE_NAME})
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LIVENESS = "liveness"


def registry_from_config(config: RouterConfig) -> WorkerRegistry:
    if config.discovery_kind == "k8s":
        from tandem.services.common.k8s_registry import KubernetesRegistry, pod_namespace

        return KubernetesRegistry(namespace=config.k8s_namespace or pod_namespace(), selector=config.k8s_selector,
                                  api_server=config.k8s_api_server, channel=config.auth.channel)
    if config.discovery_kind == "redis":
        return create_registry("redis", url=config.redis_url, prefix=config.registry_prefix)
    return create_registry(
        "static", prefill=config.prefill, decode=config.decode, colocated=config.colocated,
        model=config.model, probe_s=config.probe_s, channel=config.auth.channel,
    )


class RouterServer:
    """create → `start()` (listening, registry watched) → serve → `stop(grace)` (idempotent).

    `registry` may be injected (tests); otherwise it is built from the config. The server owns it
    either way and closes it on stop.
    """

    def __init__(self, config: RouterConfig, registry: WorkerRegistry | None = None):
        self.config = config
        self.registry = registry if registry is not None else registry_from_config(config)
        self.metrics = RouterMetrics()
        self.channels = ChannelPool(close_grace_s=max(config.request_timeout_s, 1.0), channel=config.auth.channel)
        self.health = health.aio.HealthServicer()
        # KV events travel through the Redis registry; with static or Kubernetes discovery the planner
        # keeps its approximate index alone.
        redis_url = getattr(self.registry, "url", None) if config.discovery_kind == "redis" else None
        self.kv_feed = KVEventFeed(redis_url, self.metrics) if redis_url else None
        self.servicer = GenerationServicer(config, self.registry, self.channels, self.metrics,
                                           EventPrefixView(self.kv_feed.index) if self.kv_feed is not None else None)
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._stopped = False

    @property
    def grpc_addr(self) -> str:
        assert self.port is not None, "not started"
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"{host}:{self.port}"

    def can_route(self) -> bool:
        """Every role the mode routes to has a worker; prefill only `--min-prefill-workers` of them."""
        need = {worker_pb2.WORKER_ROLE_PREFILL: self.config.min_prefill_workers}
        return all(len(self.registry.workers(role)) >= need.get(role, 1) for role in self.config.roles)

    async def start(self) -> None:
        await self._set_health(False)
        # Liveness (Kubernetes probes): alive whether or not there are workers to route to.
        await self.health.set(LIVENESS, SERVING)
        self.registry.add_listener(self._on_workers_changed)
        server = grpc.aio.server(
            options=(
                ("grpc.max_receive_message_length", self.config.limits.max_request_bytes),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
                *keepalive.SERVER_OPTIONS,
            ),
            # Reflection describes the public API: it is as open as that API (or wants the same key).
            interceptors=[self.config.auth.server_interceptor(PUBLIC_SERVICES, self.config.api_key)],
        )
        self.config.auth.announce("router")
        generation_pb2_grpc.add_GenerationServicer_to_server(self.servicer, server)
        # Not public: only the gateway (internal secret) may ask for a runtime adapter update.
        generation_pb2_grpc.add_LoraAdminServicer_to_server(
            RouterLoraAdmin(self.registry, self.channels, self.config.roles), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((GENERATION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        self.port = server.add_insecure_port(self.config.grpc_addr)
        if not self.port:  # older grpc returns 0 instead of raising
            raise RuntimeError(f"cannot listen on {self.config.grpc_addr}")
        self._server = server
        # Registry first: health is right by the time the port accepts calls.
        await self.registry.start()
        if self.kv_feed is not None:
            await self.kv_feed.start()
        await self._on_workers_changed()
        await server.start()
        if self.config.metrics_port >= 0:
            self.metrics_port = self.metrics.serve(self.config.host, self.config.metrics_port)
            log.info("metrics on http://%s:%d/metrics", self.config.host, self.metrics_port)
        log.info("router listening on %s (mode %s, policy %s)", self.grpc_addr, self.config.mode, self.config.policy)

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting calls, let in-flight ones finish for up to `grace` s, then release everything."""
        if self._stopped:
            return
        self._stopped = True
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(self.config.drain_timeout_s if grace is None else grace)
        if self.kv_feed is not None:
            await self.kv_feed.close()
        await self.registry.close()
        await self.channels.close()
        self.metrics.close()
        log.info("router stopped")

    async def wait_for_termination(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()

    async def _set_health(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        for service in ("", GENERATION_SERVICE):
            await self.health.set(service, status)

    async def _on_workers_changed(self) -> None:
        for role, name in ROLE_NAMES.items():
            self.metrics.workers.labels(name).set(len(self.registry.workers(role)))
        self.channels.retain(w.grpc_addr for w in self.registry.all_workers())
        if self.servicer.breakers is not None:
            self.servicer.breakers.retain(self.registry.all_workers())
        self.servicer.planner.retain(w.worker_id for w in self.registry.all_workers())
        if self.kv_feed is not None:
            self.kv_feed.sync(self.registry.all_workers())
        await self._set_health(self.can_route())


async def serve(config: RouterConfig) -> int:
    """Run until SIGTERM/SIGINT; print the TANDEM_READY line once listening."""
    # Handlers first: a supervisor may signal as soon as it reads the READY line.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = RouterServer(config)
    try:
        await server.start()
    except Exception as e:
        await server.stop(0)
        print(f"error: router failed to start: {e}", file=sys.stderr)
        return 1
    print("TANDEM_READY " + json.dumps({"role": "router", "grpc_addr": server.grpc_addr,
                                        "metrics_port": server.metrics_port}), flush=True)
    await stop.wait()
    log.info("signal received: draining for up to %.1f s", config.drain_timeout_s)
    await server.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        config = RouterConfig.from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return asyncio.run(serve(config))
