"""`tandem up`: the whole stack on this machine (what `make run` runs)."""

from __future__ import annotations

import argparse

from engine.config import EngineConfig
from services.common.arg_groups import (
    DEPLOYMENT,
    DISAGGREGATION,
    LIMITS,
    OBSERVABILITY,
    RESILIENCE,
    ROUTING,
    arg_group,
)
from services.common.limits import RequestLimits, limit_argv
from services.common.tls import tls_argv, tls_from_args
from services.router.config import RouterConfig, add_resilience_arguments
from tandem.engine_args import add_engine_arguments, engine_argv
from tandem.worker_cmd import add_fault_arguments, add_observability_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    from services.common.auth import add_api_key_argument, add_internal_auth_arguments
    from services.common.limits import add_limit_arguments
    from services.common.tls import add_tls_arguments
    from services.router.policy import policy_names
    from services.router.route_config import add_route_arguments
    from services.worker.config import WorkerConfig

    worker, router = WorkerConfig(role=""), RouterConfig()
    add_engine_arguments(p)
    where = arg_group(p, DEPLOYMENT)
    where.add_argument("--mode", choices=["disagg", "colocated"], default="disagg",
                       help="disagg: separate prefill and decode workers; colocated: one worker doing both")
    where.add_argument("--prefill", type=int, default=1, help="prefill workers (disagg)")
    where.add_argument("--decode", type=int, default=1, help="decode workers (disagg)")
    where.add_argument("--colocated", "--dp-size", dest="colocated", type=int, default=1, metavar="N",
                       help="co-located workers (colocated): N data-parallel replicas, each with its own share of "
                            "the cores, behind the router (like SGLang's --dp-size)")
    where.add_argument("--host", default="127.0.0.1", help="address every service listens on")
    where.add_argument("--port", type=int, default=50051, help="router's gRPC port (0: any free port)")
    where.add_argument("--gateway-port", type=int, default=8000,
                       help="OpenAI-compatible HTTP gateway's port (0: any free port, -1: no gateway)")
    where.add_argument("--redis-url", default=None, help="use this Redis instead of an embedded one")
    where.add_argument("--cpu-cores", default="auto", metavar="SPEC",
                       help="CPU placement. auto: give each worker its own share of the cores this process may use "
                            "(prefill workers first; gateway/router/Redis get a core of their own when there are "
                            "more cores than workers and at least 3); a core list (0-7): split those instead; one "
                            "list per worker separated by '|' (0-3|4-7, like VLLM_CPU_OMP_THREADS_BIND); none or "
                            "nobind: no pinning. A pinned worker runs one torch thread per core unless "
                            "--num-threads is given")
    pd = arg_group(p, DISAGGREGATION)
    pd.add_argument("--transfer-backend", default="auto", help="auto | shm | tcp | nixl | ucx")
    pd.add_argument("--bootstrap-timeout", type=float, default=30.0,
                    help="workers: seconds a request waits for its peer's half of the bootstrap handshake")
    pd.add_argument("--transfer-timeout", type=float, default=30.0,
                    help="workers: seconds a KV transfer may go without progress (a slow prefill that keeps "
                         "reporting progress is waited for)")
    pd.add_argument("--require-rdma", action="store_true",
                    help="workers: fail at start unless UCX can use RDMA (nixl/ucx backends)")
    arg_group(p, ROUTING).add_argument("--policy", default=router.policy, choices=policy_names(),
                                       help="router policy: round_robin | least_load | cache_aware")
    add_route_arguments(p)
    # None: the worker's (router's) own default, which is what the help shows; only a given value is forwarded.
    resilience = arg_group(p, RESILIENCE)
    resilience.add_argument("--drain-timeout", type=float, default=None, metavar="SECONDS",
                            help="workers: seconds to finish in-flight work and owed KV transfers on SIGTERM "
                                 f"(default: {worker.drain_timeout_s:g})")
    resilience.add_argument("--watchdog-timeout", type=float, default=None, metavar="SECONDS",
                            help="workers: an engine step still running after this long dumps stacks and exits "
                                 f"the worker (0: off; default: {worker.watchdog_timeout_s:g})")
    resilience.add_argument("--max-restarts", type=int, default=20, metavar="N",
                            help="restart a worker, the router, the gateway or the embedded Redis that dies, at "
                                 "most N times each (exponential backoff from 0.5s; each restart is logged with the "
                                 "exit status); 0: never (a dead router or gateway then stops everything)")
    add_api_key_argument(p, "the HTTP gateway requires `Authorization: Bearer KEY` and the router's gRPC API (and "
                            "its reflection) the metadata `authorization: Bearer KEY`")
    add_internal_auth_arguments(p)
    add_tls_arguments(p)
    add_limit_arguments(p)
    arg_group(p, LIMITS).add_argument(
        "--max-inflight", type=int, default=None,
        help=f"router: requests in flight beyond which new ones are refused (HTTP 429; default: "
             f"{router.max_inflight})")
    output = arg_group(p, OBSERVABILITY)
    output.add_argument("--quiet", action="store_true",
                        help="no banner and no service logs, only the services' readiness lines and errors")
    output.add_argument("--ready-json", action="store_true",
                        help="once everything is ready, print one line `TANDEM_UP {json}` on stdout (addresses of "
                             "router, gateway, workers, metrics ports): for scripts and tests")
    add_observability_arguments(p, worker)
    add_fault_arguments(p, worker)
    add_resilience_arguments(p, router)


def _engine_argv(args: argparse.Namespace) -> list[str]:
    """Forward the engine flags that were set to every worker."""
    out = [*engine_argv(args),
           "--bootstrap-timeout", str(args.bootstrap_timeout), "--transfer-timeout", str(args.transfer_timeout)]
    if args.watchdog_timeout is not None:
        out += ["--watchdog-timeout", str(args.watchdog_timeout)]
    if args.drain_timeout is not None:
        out += ["--drain-timeout", str(args.drain_timeout)]
    if args.require_rdma:
        out.append("--require-rdma")
    out += ["--log-stats-interval", str(args.log_stats_interval)]
    out += _token_file_flag(args) + tls_argv(args)
    if args.profile_dir is not None:
        out += ["--profile-dir", args.profile_dir]
    if args.step_trace_dir is not None:
        out += ["--step-trace-dir", args.step_trace_dir]
    out += ["--peer-probe-interval", str(args.peer_probe_interval)]
    if args.fault_inject:
        out += ["--fault-inject", args.fault_inject]
    if args.enable_fault_injection:
        out.append("--enable-fault-injection")
    return out


def _token_file_flag(args: argparse.Namespace) -> list[str]:
    """`--internal-token-file` goes to every child (a path, not the secret, is on their command line)."""
    return ["--internal-token-file", args.internal_token_file] if args.internal_token_file else []


def _priority_flags(args: argparse.Namespace) -> list[str]:
    return ([*(["--enable-priority-scheduling"] if args.enable_priority_scheduling else []),
             *(["--low-priority-values-first"] if args.low_priority_values_first else [])])


def _router_argv(args: argparse.Namespace) -> list[str]:
    out = ["--max-inflight", str(args.max_inflight)] if args.max_inflight is not None else []
    # The router queues only when asked: its default (0) refuses at --max-inflight, as before.
    if args.max_queued_requests != EngineConfig().max_queued_requests:
        out += ["--max-queued-requests", str(args.max_queued_requests)]
    out += ["--retry-max-retries", str(args.retry_max_retries), "--cb-failure-threshold",
            str(args.cb_failure_threshold), "--cb-timeout-duration-secs", str(args.cb_timeout_duration_secs)]
    if args.disable_circuit_breaker:
        out.append("--disable-circuit-breaker")
    from services.router.route_config import route_argv

    return out + _priority_flags(args) + route_argv(args) + _token_file_flag(args) + tls_argv(args) + limit_argv(args)


def run(args: argparse.Namespace) -> int:
    from services.launcher.up import UpConfig, run_up
    from services.worker.config import WorkerConfig
    from services.worker.faults import FaultSpecError
    from tandem.worker_cmd import fault_config

    try:
        fault_config(args)  # refuse a bad or unauthorized --fault-inject before starting anything
    except FaultSpecError as e:
        print(f"error: {e}", flush=True)
        return 2

    try:
        RequestLimits.from_args(args)
        tls_from_args(args)
    except ValueError as e:
        print(f"error: {e}", flush=True)
        return 2
    # Workers drain for up to their drain timeout on SIGTERM: only stragglers past it get SIGKILL.
    drain_s = args.drain_timeout if args.drain_timeout is not None else WorkerConfig(role="").drain_timeout_s
    cfg = UpConfig(
        mode=args.mode, num_prefill=args.prefill, num_decode=args.decode,
        num_colocated=args.colocated, host=args.host, port=args.port,
        redis_url=args.redis_url, transfer_backend=args.transfer_backend, policy=args.policy,
        worker_args=tuple(_engine_argv(args)), quiet=args.quiet, ready_json=args.ready_json,
        stop_grace_s=drain_s + 10.0, gateway_port=args.gateway_port, api_key=args.api_key,
        router_args=tuple(_router_argv(args)), gateway_args=tuple(_token_file_flag(args) + limit_argv(args)),
        cpu_cores=args.cpu_cores, internal_token_file=args.internal_token_file, max_restarts=args.max_restarts,
    )
    if cfg.mode == "disagg" and (cfg.num_prefill < 1 or cfg.num_decode < 1):
        print("error: --prefill and --decode must be >= 1", flush=True)
        return 2
    if cfg.mode == "colocated" and cfg.num_colocated < 1:
        print("error: --colocated must be >= 1", flush=True)
        return 2
    if cfg.max_restarts < 0:
        print("error: --max-restarts must be >= 0", flush=True)
        return 2
    if not -1 <= cfg.gateway_port < 65536:
        print("error: --gateway-port must be in [-1, 65535]", flush=True)
        return 2
    return run_up(cfg)
