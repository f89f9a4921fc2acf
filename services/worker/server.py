"""One worker process: engine thread + grpc.aio server + /metrics + registry heartbeat.

Lifecycle: build (load the model, set up the transfer backend) -> start (serve, announce) ->
serve until SIGTERM/SIGINT -> drain (NOT_SERVING, withdraw, let in-flight requests finish) -> close.
Role-specific parts (servicers, step worker) come from `ROLES`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import faulthandler
import importlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.engine.config import EngineConfig
from tandem.engine.models.source import default_cache_dir
from tandem.services.common import keepalive
from tandem.services.common.cpu_cores import CpuListError, format_cpu_list, pin
from tandem.services.common.registry import create_registry
from tandem.services.worker import metrics, step_stats
from tandem.services.worker.config import WorkerConfig
from tandem.services.worker.faults import FaultInjector
from tandem.services.worker.identity import WorkerIdentityServicer
from tandem.services.worker.kv_events import REGISTRY_PREFIX, KVEventSender, event_source
from tandem.services.worker.loop import EngineLoop
from tandem.services.worker.lora_admin import WorkerLoraAdmin
from tandem.services.worker.lora_report import LoraInfoExporter, with_lora
from tandem.services.worker.metrics_server import start_metrics_server
from tandem.services.worker.peers import PeerMonitor
from tandem.services.worker.profiler import StepProfiler
from tandem.services.worker.rdma import preflight
from tandem.services.worker.spec_metrics import SpecMetrics
from tandem.services.worker.step_stats import StepStats, StepTrace
from tandem.services.worker.watchdog import Watchdog
from tandem.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

# gRPC health service name that answers SERVING while the process is alive, through a drain too
# (Kubernetes liveness/startup probes); "" and the role's services answer readiness.
LIVENESS = "liveness"


@dataclass
class RoleParts:
    """What a role contributes to the generic worker process."""

    worker: object                                  # the StepWorker run by the engine thread
    role_pb: int                                    # worker_pb2.WorkerRole
    service_names: list[str]                        # full names, for reflection and health
    add_servicers: Callable[[grpc.aio.Server, EngineLoop], None]
    engine: object
    transfer_backend: str = ""
    close: Callable[[], None] = lambda: None        # transfer backend teardown
    inflight: Callable[[], int] = lambda: 0          # requests (P: rooms, incl. transfers owed) in flight
    outstanding: Callable[[], int] = lambda: 0       # P: KV transfers owed to decode workers
    on_listening: Callable[[str], None] = lambda addr: None  # told the gRPC address peers reach us at
    extra: dict = field(default_factory=dict)


# role -> builder(engine_cfg, worker_cfg, aio_loop) -> RoleParts (registered by each service package)
ROLES: dict[str, Callable[[EngineConfig, WorkerConfig, asyncio.AbstractEventLoop], Awaitable[RoleParts] | RoleParts]] = {}


def register_role(name: str):
    def deco(fn):
        ROLES[name] = fn
        return fn
    return deco


# Where each role's builder lives; importing the module registers it (only the role being run is
# imported, so a co-located worker never loads transfer backends).
ROLE_MODULES = {
    "prefill": "tandem.services.prefill.role",
    "decode": "tandem.services.decode.role",
    "colocated": "tandem.services.colocated.role",
}


def _load_role(role: str) -> None:
    if role not in ROLE_MODULES:
        raise SystemExit(f"unknown worker role {role!r}; known: {sorted(ROLE_MODULES)}")
    importlib.import_module(ROLE_MODULES[role])


async def serve_worker(engine_cfg: EngineConfig, wcfg: WorkerConfig) -> int:
    _load_role(wcfg.role)
    preflight(wcfg)
    try:  # before the model loads, so that a bad path fails at once
        trace = StepTrace(wcfg.step_trace_dir, wcfg.id) if wcfg.step_trace_dir else None
    except OSError as e:
        raise SystemExit(f"--step-trace-dir {wcfg.step_trace_dir}: cannot write step traces there: {e}") from None
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # `kill -USR1`: every thread's stack to stderr (the launcher asks before it kills a worker that
    # would not stop); faulthandler's C handler answers even while a thread holds the GIL, then (chain)
    # the event loop prints where each of its tasks waits.
    loop.add_signal_handler(signal.SIGUSR1, _print_tasks)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)

    t0 = time.monotonic()
    # Model loading takes seconds: run it off the event loop so signals are still handled.
    parts: RoleParts = await asyncio.to_thread(_build_sync, engine_cfg, wcfg, loop)
    engine = parts.engine
    worker_load = with_lora(parts.worker.load, engine)   # + the adapters' report when LoRA is on
    stats = StepStats(engine.runner, parts.worker.load, wcfg.id, wcfg.log_stats_interval_s, trace=trace)
    profiler = StepProfiler(wcfg.profile_dir or default_cache_dir() / "profiles", wcfg.id)
    # The watchdog sees a step first, so that everything after it (an injected hang too) is timed.
    watchdog = Watchdog(wcfg.watchdog_timeout_s) if wcfg.watchdog_timeout_s > 0 else None
    faults = wcfg.faults
    guards = [g for g in (watchdog, FaultInjector(faults) if faults.any else None) if g is not None]
    spec = [SpecMetrics(engine.spec)] if getattr(engine, "spec", None) is not None else []
    kv_events = _open_kv_events(engine, wcfg)   # before the engine thread starts: it flushes them
    engine_loop = EngineLoop(parts.worker, loop, on_fatal=stop.set, observers=(*guards, stats, *spec, profiler),
                             tickers=(*((engine.kv_events.flush,) if kv_events is not None else ()),
                                      *((LoraInfoExporter(engine),) if engine_cfg.enable_lora else ())))

    wcfg.auth.announce(f"{wcfg.role} {wcfg.id}")
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20), *keepalive.SERVER_OPTIONS],
                             interceptors=[wcfg.auth.server_interceptor()])
    parts.add_servicers(server, engine_loop)
    identity = WorkerIdentityServicer(lambda: engine_loop.call(worker_load))
    worker_pb2_grpc.add_WorkerIdentityServicer_to_server(identity, server)
    registry = None
    if engine_cfg.enable_lora:   # runtime loads; what it serves is announced at once after one
        async def lora_changed() -> None:
            if registry is not None:
                await registry.report(await engine_loop.call(worker_load))
        generation_pb2_grpc.add_LoraAdminServicer_to_server(
            WorkerLoraAdmin(engine, engine_loop, wcfg.id, lora_changed), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    identity_name = worker_pb2.DESCRIPTOR.services_by_name["WorkerIdentity"].full_name
    reflection.enable_server_reflection(
        [*parts.service_names, identity_name, health.SERVICE_NAME, reflection.SERVICE_NAME,
         *(["tandem.v1.LoraAdmin"] if engine_cfg.enable_lora else [])], server)
    port = wcfg.auth.add_port(server, f"{wcfg.host}:{wcfg.port}")
    if port == 0:
        raise SystemExit(f"cannot listen on {wcfg.host}:{wcfg.port}")
    addr = f"{wcfg.public_host}:{port}"
    parts.on_listening(addr)
    engine_loop.start()
    if watchdog is not None:
        watchdog.start()
    await server.start()
    for name in [LIVENESS, "", *parts.service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    monitor = None
    if wcfg.peer_probe_s > 0 and hasattr(parts.worker, "peer_lost"):
        monitor = PeerMonitor(engine_loop, parts.worker, wcfg.peer_probe_s)
        monitor.start()
    metrics_port = _start_metrics(wcfg, profiler)
    info = worker_pb2.WorkerInfo(
        worker_id=wcfg.id, role=parts.role_pb, grpc_addr=addr,
        bootstrap_addr=addr if wcfg.role == "prefill" else "",
        model=engine_cfg.model, transfer_backend=parts.transfer_backend, started_at=time.time(),
        max_context_len=engine.context_len, vocab_size=engine.model_config.vocab_size,
        load=worker_load(), pod_uid=wcfg.pod_uid, boot_epoch=wcfg.boot_epoch,
        kv_events=kv_events.source if kv_events is not None else None,
        lora_adapters=sorted(engine.loras.known),
        kv_bytes_per_token=_kv_bytes_per_token(engine.runner.pool.spec),
    )
    identity.info = info
    heartbeat = None
    if wcfg.redis_url:
        registry = create_registry("redis", url=wcfg.redis_url, heartbeat_s=wcfg.heartbeat_s)
        await registry.start()
        await registry.announce(info)
        heartbeat = asyncio.create_task(_report_load(registry, engine_loop, worker_load, wcfg.heartbeat_s))
    ready = {"role": wcfg.role, "worker_id": wcfg.id, "grpc_addr": addr, "metrics_port": metrics_port,
             "pid": os.getpid(), "boot_epoch": wcfg.boot_epoch,
             "transfer_backend": parts.transfer_backend, "startup_s": round(time.monotonic() - t0, 2),
             "cpu_cores": format_cpu_list(wcfg.cpu_cores) if wcfg.cpu_cores else None,
             "num_threads": engine_cfg.num_threads, "dtype": str(engine.runner.dtype).removeprefix("torch."),
             "hardware": engine.runner.hardware.summary(), "engine_choices": engine.runner.describe_choices()}
    print("TANDEM_READY " + json.dumps(ready), flush=True)
    log.info("%s %s serving on %s (metrics :%s)", wcfg.role, wcfg.id, addr, metrics_port)

    await stop.wait()
    clock = _StopClock(f"{wcfg.role} {wcfg.id}")
    await _drain(wcfg, health_servicer, registry, heartbeat, parts)
    clock.lap("drain", budget_s=wcfg.drain_timeout_s + STALE_VIEW_S)
    if monitor is not None:
        await monitor.close()
    await server.stop(grace=1.0)
    clock.lap("gRPC server")
    engine_loop.stop()
    if watchdog is not None:
        watchdog.stop()
    clock.lap("engine thread")
    parts.close()
    clock.lap("engine and KV transfer")
    if kv_events is not None:
        kv_events.close()
    stats.close()
    clock.lap("KV events and stats")
    log.info("%s stopped (%s)", clock.name, clock)
    return 1 if engine_loop.failed else 0


def _print_tasks() -> None:
    """Where each task of the event loop waits: its chain of awaits, outermost first (Task.print_stack
    shows only the outermost frame of a suspended coroutine, and fails on some compiled ones)."""
    for task in asyncio.all_tasks():
        chain, coro = [], task.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is None:
                chain.append(type(coro).__name__)
                break
            chain.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        print(f"Task {task.get_name()}: " + " -> ".join(chain), file=sys.stderr)
    sys.stderr.flush()


class _StopClock:
    """Times the stop's phases: one slower than its budget is logged at once (the launcher SIGKILLs a
    worker whose whole stop outlasts its grace period, so which phase hung must be on record)."""

    SLOW_S = 3.0

    def __init__(self, name: str):
        self.name = name
        self.t = time.monotonic()
        self.laps: list[tuple[str, float]] = []

    def lap(self, phase: str, budget_s: float = SLOW_S) -> None:
        now = time.monotonic()
        self.laps.append((phase, now - self.t))
        if now - self.t > budget_s:
            log.warning("%s: stopping, the %s took %.1fs", self.name, phase, now - self.t)
        self.t = now

    def __str__(self) -> str:
        return ", ".join(f"{phase} {s:.2f}s" for phase, s in self.laps)


# How long a drained worker stays idle before it stops serving: twice a router's registry poll
# (0.5 s), so a request routed on a view from before the withdrawal is served,
# not cancelled by the server's stop (the [19] reshape e2e test caught one CANCELLED that way).
STALE_VIEW_S = 1.0


async def _drain(wcfg: WorkerConfig, health_servicer, registry, heartbeat, parts: RoleParts) -> None:
    """Leave routing first (NOT_SERVING fails the readiness probe, so Kubernetes drops the endpoint;
    the Redis entry is deleted), then keep serving what is in flight: a prefill worker stays until
    every KV transfer it owes has completed or timed out (its own transfer timeout fails them), all
    within `drain_timeout_s`. Requests that still arrive from a router with a stale view are served:
    the worker stops only once it has been idle for STALE_VIEW_S."""
    t0 = time.monotonic()
    log.info("%s %s draining: %d in flight, %d KV transfers outstanding",
             wcfg.role, wcfg.id, parts.inflight(), parts.outstanding())
    metrics.DRAINING.set(1)
    # Not enter_graceful_shutdown(): LIVENESS stays SERVING so a liveness probe does not kill the drain.
    for name in ["", *parts.service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if heartbeat is not None:
        heartbeat.cancel()
    if registry is not None:
        await registry.withdraw()
        await registry.close()
    deadline = t0 + wcfg.drain_timeout_s
    quiet_since = None   # idle must last STALE_VIEW_S: a router polling the registry may still send one
    while time.monotonic() < deadline:
        now = time.monotonic()
        if parts.inflight():
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= STALE_VIEW_S:
            break
        await asyncio.sleep(0.05)
    left, owed = parts.inflight(), parts.outstanding()
    if left:
        log.warning("%s %s drain timed out after %.1fs: %d requests, %d KV transfers still in flight",
                    wcfg.role, wcfg.id, wcfg.drain_timeout_s, left, owed)
    else:
        log.info("%s %s drained in %.2fs", wcfg.role, wcfg.id, time.monotonic() - t0)


def _open_kv_events(engine, wcfg: WorkerConfig) -> KVEventSender | None:
    """Follow the engine's prefix cache and tiers and publish their KV events to this worker's Redis
    stream (docs/kv-cache.md), when `--kv-events` (default: with a Redis registry)."""
    if not wcfg.publishes_kv_events:
        if wcfg.kv_events:
            log.warning("--kv-events needs the Redis registry (--redis-url): KV events are off")
        return None
    link = engine.open_kv_events()
    link.open(wcfg.id, epoch=wcfg.boot_epoch)   # one boot, one epoch
    sender = KVEventSender(link, wcfg.redis_url, event_source(REGISTRY_PREFIX, wcfg.id, link.namespace))
    sender.start()
    return sender


def _build_sync(engine_cfg: EngineConfig, wcfg: WorkerConfig, loop) -> RoleParts:
    return ROLES[wcfg.role](engine_cfg, wcfg, loop)


async def _report_load(registry, engine_loop: EngineLoop, load, period: float) -> None:
    while True:
        await asyncio.sleep(period)
        try:
            registry.update_load(await engine_loop.call(load))
        except Exception:  # never let a metrics hiccup kill the heartbeat
            log.exception("load report failed")


def _start_metrics(wcfg: WorkerConfig, profiler: StepProfiler) -> int:
    if wcfg.metrics_port < 0:
        return -1
    return start_metrics_server(wcfg.host, wcfg.metrics_port, profiler).server_port


def place(engine_cfg: EngineConfig, wcfg: WorkerConfig) -> EngineConfig:
    """Pin this process to `wcfg.cpu_cores` (before any thread pool starts: threads inherit the
    mask) and give torch one thread per core unless --num-threads said otherwise. Raises CpuListError."""
    if wcfg.cpu_cores is None:
        return engine_cfg
    pin(wcfg.cpu_cores)
    log.info("pinned to core(s) %s", format_cpu_list(wcfg.cpu_cores))
    if engine_cfg.num_threads is None:
        return dataclasses.replace(engine_cfg, num_threads=len(wcfg.cpu_cores))
    return engine_cfg


def run(engine_cfg: EngineConfig, wcfg: WorkerConfig) -> int:
    try:
        engine_cfg = place(engine_cfg, wcfg)
    except CpuListError as e:
        print(f"error: --cpu-cores: {e}", file=sys.stderr)
        return 2
    if wcfg.log_stats_interval_s > 0 and not step_stats.log.isEnabledFor(logging.INFO):
        step_stats.log.setLevel(logging.INFO)  # the busy line shows unless --log-stats-interval 0
    # Start-up lines a person waits on: the hardware-dependent settings and the model load
    # (engine.runner.model_runner), the progress line while decode graphs are captured; and the one
    # line per KV peer saying which data path its link uses (shm, tcp, nixl, ucx) and why not another.
    for name in ("tandem.engine.runner.model_runner", "tandem.engine.runner.graph_runner",
                 "tandem.kvtransfer.protocol.sender"):
        start_log = logging.getLogger(name)
        if not start_log.isEnabledFor(logging.INFO):
            start_log.setLevel(logging.INFO)
    try:
        return asyncio.run(serve_worker(engine_cfg, wcfg))
    except KeyboardInterrupt:
        return 0
    except SystemExit as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _kv_bytes_per_token(spec) -> int:
    """KV cache bytes of one token, every layer, K and V (what a transfer of it moves)."""
    return spec.page_bytes * spec.num_layers * 2 // spec.page_size
