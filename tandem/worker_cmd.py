"""`tandem prefill | decode | colocated`: one worker process."""

from __future__ import annotations

import argparse
import sys
from functools import partial

from services.common.arg_groups import DEPLOYMENT, DISAGGREGATION, OBSERVABILITY, RESILIENCE, arg_group
from tandem.engine_args import add_engine_arguments, engine_config_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    from services.worker.config import WorkerConfig

    d = WorkerConfig(role="")
    add_engine_arguments(p)
    where = arg_group(p, DEPLOYMENT)
    where.add_argument("--host", default=d.host, help="address to listen on")
    where.add_argument("--port", type=int, default=d.port, help="0: any free port")
    where.add_argument("--advertise-host", default=None, help="address peers use to reach this worker")
    where.add_argument("--worker-id", default=None,
                       help="this worker's id in the registry and in logs (default: ROLE-HOSTNAME-PID)")
    where.add_argument("--redis-url", default=None,
                       help="announce in this registry (e.g. redis://127.0.0.1:6379)")
    where.add_argument("--pod-uid", default=d.pod_uid,
                       help="Kubernetes pod UID (downward API metadata.uid), reported to Kubernetes discovery")
    where.add_argument("--cpu-cores", type=_cpu_cores, default=None, metavar="LIST",
                       help="pin this worker to these cores (Linux cpulist: 0, 0-3, 0,2) and run one torch thread "
                            "per core unless --num-threads is given; none/nobind: no pinning (the default; `tandem "
                            "up` gives each worker its own cores)")
    pd = arg_group(p, DISAGGREGATION)
    pd.add_argument("--transfer-backend", default=d.transfer_backend, help="auto | shm | tcp | nixl | ucx")
    pd.add_argument("--bootstrap-timeout", type=float, default=d.bootstrap_timeout_s,
                    help="seconds a request waits for its peer worker's half of the bootstrap handshake "
                         "before it fails on both sides")
    pd.add_argument("--transfer-timeout", type=float, default=d.transfer_timeout_s,
                    help="seconds without progress before a request's KV transfer fails on both sides: on a "
                         "decode worker, since the bootstrap or the prefill worker's last progress report (a long "
                         "prefill on a slow CPU is waited for while it keeps reporting); on a prefill worker, after "
                         "its last chunk is computed")
    pd.add_argument("--max-queue", type=int, default=d.max_queue,
                    help="prefill: bootstrap rooms (requests waiting for their decode worker's half of the "
                         "handshake) beyond which new ones get RESOURCE_EXHAUSTED; queues waiting for compute "
                         "are bounded by --max-queued-requests")
    pd.add_argument("--require-rdma", action="store_true",
                    help="nixl/ucx: exit at start without an RDMA device, refuse peers UCX reaches without RDMA")
    resilience = arg_group(p, RESILIENCE)
    resilience.add_argument("--watchdog-timeout", type=float, default=d.watchdog_timeout_s, metavar="SECONDS",
                            help="an engine step (scheduling + forward pass) still running after this long logs "
                                 "every thread's stack and exits the worker non-zero, for its supervisor to "
                                 "restart; 0: off")
    resilience.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s,
                            help="SIGTERM: seconds to finish in-flight work (a prefill worker: the KV transfers "
                                 "it owes) before exiting; keep it below the pod's terminationGracePeriodSeconds")
    arg_group(p, OBSERVABILITY).add_argument("--metrics-port", type=int, default=d.metrics_port,
                                             help="0: any free port, -1: off")
    add_observability_arguments(p, d)
    add_fault_arguments(p, d)
    from services.common.auth import add_internal_auth_arguments
    from services.common.tls import add_tls_arguments

    add_internal_auth_arguments(p)
    add_tls_arguments(p)


def add_observability_arguments(p: argparse.ArgumentParser, d) -> None:
    """Worker flags that `tandem up` also takes and forwards."""
    g = arg_group(p, OBSERVABILITY)
    g.add_argument("--log-stats-interval", type=float, default=d.log_stats_interval_s, metavar="SECONDS",
                   help="while busy, log one line this often: running/queued requests, prefill and decode "
                        "tokens/s, KV usage (like SGLang's decode log); 0: off")
    g.add_argument("--profile-dir", default=None,
                   help="where `POST /profile?steps=N` on the metrics port writes torch.profiler Chrome traces "
                        "(default: $TANDEM_CACHE_DIR/profiles, else ~/.cache/tandem/profiles)")
    g.add_argument("--step-trace-dir", default=None, metavar="DIR",
                   help="append one JSON line per forward pass (end time, kind, decode tokens, prefill tokens, "
                        "seconds) to DIR/<worker id>.jsonl; `python -m bench.sched_sim` fits its step costs to "
                        "these (default: off)")


def add_fault_arguments(p: argparse.ArgumentParser, d) -> None:
    """Worker flags for chaos drills and peer liveness that `tandem up` also takes and forwards."""
    g = arg_group(p, RESILIENCE)
    g.add_argument("--peer-probe-interval", type=float, default=d.peer_probe_s, metavar="SECONDS",
                   help="probe the liveness of every peer worker this one has requests with this often; a peer "
                        "that misses 3 probes in a row fails only its own requests, at once; 0: off")
    g.add_argument("--fault-inject", default="", metavar="SPEC",
                   help="inject faults for tests and chaos drills, e.g. transfer_fail=0.1,transfer_delay_ms=50,"
                        "forward_delay_ms=20 (also seed=N); refused without --enable-fault-injection or "
                        "TANDEM_ALLOW_FAULTS=1 (default: none)")
    g.add_argument("--enable-fault-injection", action="store_true",
                   help="allow --fault-inject (off by default: it makes requests fail on purpose)")


def fault_config(args: argparse.Namespace):
    """The worker's FaultConfig from its flags and environment; raises FaultSpecError."""
    from services.worker.faults import FaultConfig

    return FaultConfig.load(args.fault_inject, args.enable_fault_injection)


def _cpu_cores(text: str) -> tuple[int, ...] | None:
    from services.common.cpu_cores import CpuListError, parse_worker_cores

    try:
        return parse_worker_cores(text)
    except CpuListError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(role: str, args: argparse.Namespace) -> int:

    from services.common.auth import InternalAuth
    from services.common.tls import tls_from_args
    from services.worker.config import WorkerConfig
    from services.worker.faults import FaultSpecError
    from services.worker.server import run as run_worker

    try:
        faults = fault_config(args)
    except FaultSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    try:
        auth = InternalAuth.load(args.internal_token_file, tls=tls_from_args(args))
    except ValueError as e:            # AuthConfigError, TlsConfigError
        print(f"error: {e}", file=sys.stderr)
        return 2
    wcfg = WorkerConfig(
        role=role, host=args.host, port=args.port, advertise_host=args.advertise_host, worker_id=args.worker_id,
        redis_url=args.redis_url, transfer_backend=args.transfer_backend, metrics_port=args.metrics_port,
        bootstrap_timeout_s=args.bootstrap_timeout, transfer_timeout_s=args.transfer_timeout,
        watchdog_timeout_s=args.watchdog_timeout,
        max_queue=args.max_queue, drain_timeout_s=args.drain_timeout, pod_uid=args.pod_uid,
        require_rdma=args.require_rdma, cpu_cores=args.cpu_cores, profile_dir=args.profile_dir,
        step_trace_dir=args.step_trace_dir, log_stats_interval_s=args.log_stats_interval, faults=faults, peer_probe_s=args.peer_probe_interval,
        auth=auth,
    )
    return run_worker(engine_config_from_args(args), wcfg)


run_prefill = partial(run, "prefill")
run_decode = partial(run, "decode")
run_colocated = partial(run, "colocated")
