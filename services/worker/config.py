"""A worker process's service-level config (the engine's is engine.config.EngineConfig)."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field

from services.common.auth import InternalAuth
from services.worker.faults import FaultConfig


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
