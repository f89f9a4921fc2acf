"""A worker process's service-level config (the engine's is engine.config.EngineConfig) and its flags."""

from __future__ import annotations

import argparse
import os
import secrets
import socket
from dataclasses import dataclass, field

from tandem.services.common.arg_groups import DEPLOYMENT, DISAGGREGATION, OBSERVABILITY, RESILIENCE
from tandem.services.common.auth import INTERNAL_TOKEN_FILE, InternalAuth
from tandem.services.common.cpu_cores import CpuListError, parse_worker_cores
from tandem.services.common.flags import Flag, Owner
from tandem.services.common.shared_flags import (
    DRAIN_TIMEOUT,
    HOST,
    METRICS_PORT,
    OTLP_TRACES_ENDPOINT,
    PORT,
    REDIS_URL,
)
from tandem.services.common.tls import TLS_FLAGS
from tandem.services.worker.faults import FaultConfig


def new_boot_epoch() -> int:
    """A random non-zero 63-bit id of one process start (0 means "not checked" on the wire)."""
    return secrets.randbits(63) or 1


@dataclass(frozen=True)
class WorkerConfig:
    role: str                           # prefill | decode | colocated
    host: str = "127.0.0.1"
    port: int = 0                       # 0: any free port (announced through the registry)
    advertise_host: str | None = None   # address peers use to reach us (default: host)
    worker_id: str | None = None
    redis_url: str | None = None        # None: no registry (static router lists)
    transfer_backend: str = "auto"      # auto | shm | tcp
    metrics_port: int = 0               # 0: any free port, -1: off
    bootstrap_timeout_s: float = 30.0
    transfer_timeout_s: float = 30.0
    stream_layers: int = 5              # prefill: layers per KV write streamed while a chunk computes; 0: off
    kv_reuse: bool = True               # KV both ways: prefill fetches prompt pages decode holds; decode sends them
    max_queue: int = 1024               # bootstrap rooms (P); D's prealloc queue: EngineConfig.max_queued_requests
    drain_timeout_s: float = 10.0       # SIGTERM: the most a drain waits (keep it below the pod's grace period)
    watchdog_timeout_s: float = 300.0   # a step still running after this dumps stacks and exits; 0: off
    heartbeat_s: float = 1.0
    pod_uid: str = ""                   # Kubernetes pod UID (downward API), reported in WorkerInfo
    require_rdma: bool = False          # nixl/ucx: refuse peers whose UCX transport is not RDMA
    cpu_cores: tuple[int, ...] | None = None  # pin the process to these cores (None: not pinned)
    profile_dir: str | None = None      # where POST /profile writes traces (None: <cache dir>/profiles)
    log_stats_interval_s: float = 5.0   # busy log line period; 0: off
    step_trace_dir: str | None = None   # one JSON line per step in <dir>/<worker id>.jsonl (None: off)
    faults: FaultConfig = FaultConfig()  # --fault-inject (tests and chaos drills); default: none
    peer_probe_s: float = 1.0           # liveness probe period of the peers a worker has rooms with; 0: off
    kv_events: bool | None = None       # publish KV events to the router (None: on with a Redis registry)
    # Identity of this process start, drawn once when the config is built (a restarted container gets
    # a new one): peers check it in the bootstrap handshake.
    boot_epoch: int = field(default_factory=new_boot_epoch)
    # The internal secret (services/common/auth.py): required of gRPC callers and KV senders.
    auth: InternalAuth = field(default_factory=InternalAuth, repr=False)

    @property
    def id(self) -> str:
        return self.worker_id or f"{self.role}-{socket.gethostname()}-{os.getpid()}"

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def publishes_kv_events(self) -> bool:
        """KV events travel through the Redis registry: without one there is nowhere to send them."""
        return bool(self.redis_url) and self.kv_events is not False


def _cpu_cores(text: str) -> tuple[int, ...] | None:
    try:
        return parse_worker_cores(text)
    except CpuListError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


_W = Owner.WORKER
WORKER_FLAGS = (
    HOST, PORT,
    Flag(("--advertise-host",), _W, DEPLOYMENT, "address peers use to reach this worker (default: --host)",
         field="advertise_host", up=Owner.NONE),
    Flag(("--worker-id",), _W, DEPLOYMENT,
         "this worker's id in the registry and in logs (default: ROLE-HOSTNAME-PID)", field="worker_id",
         up=Owner.NONE),
    REDIS_URL,
    Flag(("--pod-uid",), _W, DEPLOYMENT,
         "Kubernetes pod UID (downward API metadata.uid), reported to Kubernetes discovery", field="pod_uid",
         up=Owner.NONE),
    # A homonym of `tandem up --cpu-cores`, which places every worker (tests/tandem/test_flags.py).
    Flag(("--cpu-cores",), _W, DEPLOYMENT,
         "pin this worker to these cores (Linux cpulist: 0, 0-3, 0,2) and run one torch thread per core unless "
         "--num-threads is given; none/nobind: no pinning (the default)", field="cpu_cores", type=_cpu_cores,
         metavar="LIST", up=Owner.NONE),
    Flag(("--transfer-backend",), _W, DISAGGREGATION, "auto | shm | tcp | nixl | ucx", field="transfer_backend"),
    Flag(("--bootstrap-timeout",), _W, DISAGGREGATION,
         "seconds a request waits for its peer worker's half of the bootstrap handshake before it fails on both "
         "sides", field="bootstrap_timeout_s", type=float),
    Flag(("--transfer-timeout",), _W, DISAGGREGATION,
         "seconds without progress before a request's KV transfer fails on both sides: on a decode worker, since "
         "the bootstrap or the prefill worker's last progress report (a long prefill on a slow CPU is waited for "
         "while it keeps reporting); on a prefill worker, after its last chunk is computed",
         field="transfer_timeout_s", type=float),
    Flag(("--transfer-stream-layers",), _W, DISAGGREGATION,
         "prefill: send a chunk's KV to the decode worker this many layers at a time while the chunk's forward "
         "pass runs, so that only the last few layers are left to send after it (where the decode worker's data "
         "path takes layer writes: tcp, nixl; shm and ucx send after each chunk); 0: after each chunk",
         field="stream_layers", type=_non_negative, metavar="LAYERS"),
    Flag(("--kv-reuse-from-decode",), _W, DISAGGREGATION,
         "KV both ways: a prefill worker fetches the part of a prompt its decode worker already holds (in a "
         "multi-turn conversation, the earlier answers, computed only there) instead of computing it, when the "
         "router's --kv-reuse-policy asks; a decode worker sends it. The prefill worker's KV pool then lives in "
         "its transfer backend's memory, as a decode worker's does", field="kv_reuse",
         action="on_off", off=("--no-kv-reuse-from-decode",),
         off_help="prefill workers compute every token their own caches lack; decode workers refuse to send KV"),
    Flag(("--max-queue",), _W, DISAGGREGATION,
         "prefill: bootstrap rooms (requests waiting for their decode worker's half of the handshake) beyond "
         "which new ones get RESOURCE_EXHAUSTED; queues waiting for compute are bounded by --max-queued-requests",
         field="max_queue", type=int),
    Flag(("--require-rdma",), _W, DISAGGREGATION,
         "nixl/ucx: exit at start without an RDMA device, refuse peers UCX reaches without RDMA",
         field="require_rdma", action="store_true"),
    Flag(("--watchdog-timeout",), _W, RESILIENCE,
         "an engine step (scheduling + forward pass) still running after this long logs every thread's stack and "
         "exits the worker non-zero, for its supervisor to restart; 0: off", field="watchdog_timeout_s",
         type=float, metavar="SECONDS"),
    DRAIN_TIMEOUT, METRICS_PORT, OTLP_TRACES_ENDPOINT,
    Flag(("--log-stats-interval",), _W, OBSERVABILITY,
         "while busy, log one line this often: running/queued requests, prefill and decode tokens/s, KV usage "
         "(like SGLang's decode log); 0: off", field="log_stats_interval_s", type=float, metavar="SECONDS"),
    Flag(("--profile-dir",), _W, OBSERVABILITY,
         "where `POST /profile?steps=N` on the metrics port writes torch.profiler Chrome traces (default: "
         "$TANDEM_CACHE_DIR/profiles, else ~/.cache/tandem/profiles)", field="profile_dir"),
    Flag(("--step-trace-dir",), _W, OBSERVABILITY,
         "append one JSON line per forward pass (end time, kind, decode tokens, prefill tokens, seconds) to "
         "DIR/<worker id>.jsonl; `python -m tandem.bench.sched_sim` fits its step costs to these (default: off)",
         field="step_trace_dir", metavar="DIR"),
    Flag(("--peer-probe-interval",), _W, RESILIENCE,
         "probe the liveness of every peer worker this one has requests with this often; a peer that misses 3 "
         "probes in a row fails only its own requests, at once; 0: off", field="peer_probe_s", type=float,
         metavar="SECONDS"),
    Flag(("--kv-events",), _W, OBSERVABILITY,
         "publish this worker's KV block events (stored / removed per block and tier: L1 prefix cache, L2, L3) "
         "to its Redis stream, so the router's cache_aware policy sees exactly which prefixes it holds; needs "
         "the Redis registry (with static or Kubernetes discovery the router keeps its approximate index) "
         "(default: on with --redis-url)", field="kv_events", action="on_off", off=("--no-kv-events",),
         off_help="do not publish KV events (the router routes this worker by its approximate index)"),
    Flag(("--fault-inject",), _W, RESILIENCE,
         "inject faults for tests and chaos drills, e.g. transfer_fail=0.1,transfer_delay_ms=50,forward_delay_ms=20 "
         "(also kv_corrupt=P: KV corrupted in flight; seed=N); refused without --enable-fault-injection or "
         "TANDEM_ALLOW_FAULTS=1 (default: none)",
         default="", metavar="SPEC"),
    Flag(("--enable-fault-injection",), _W, RESILIENCE,
         "allow --fault-inject (off by default: it makes requests fail on purpose)", default=False,
         action="store_true"),
    INTERNAL_TOKEN_FILE, *TLS_FLAGS,
)
