"""`tandem prefill | decode | colocated`: one worker process."""

from __future__ import annotations

import argparse
import sys
from functools import partial

from tandem.cli.engine_args import ENGINE_FLAGS, engine_config_from_args
from tandem.engine.config import EngineConfig
from tandem.services.common.flags import Owner, add_flags, unique


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.services.worker.config import WORKER_FLAGS, WorkerConfig

    add_flags(p, unique(ENGINE_FLAGS, WORKER_FLAGS),
              {Owner.ENGINE: EngineConfig(), Owner.WORKER: WorkerConfig(role="")})


def fault_config(args: argparse.Namespace):
    """The worker's FaultConfig from its flags and environment; raises FaultSpecError."""
    from tandem.services.worker.faults import FaultConfig

    return FaultConfig.load(args.fault_inject, args.enable_fault_injection)


def run(role: str, args: argparse.Namespace) -> int:
    from tandem.services.common import tracing
    from tandem.services.common.auth import InternalAuth
    from tandem.services.common.tls import tls_from_args
    from tandem.services.worker.config import WorkerConfig
    from tandem.services.worker.faults import FaultSpecError
    from tandem.services.worker.server import run as run_worker

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
        stream_layers=args.transfer_stream_layers,
        watchdog_timeout_s=args.watchdog_timeout,
        max_queue=args.max_queue, drain_timeout_s=args.drain_timeout, pod_uid=args.pod_uid,
        require_rdma=args.require_rdma, cpu_cores=args.cpu_cores, profile_dir=args.profile_dir,
        step_trace_dir=args.step_trace_dir, log_stats_interval_s=args.log_stats_interval, faults=faults,
        peer_probe_s=args.peer_probe_interval, kv_events=args.kv_events, auth=auth,
        kv_reuse=WorkerConfig.kv_reuse if args.kv_reuse_from_decode is None else args.kv_reuse_from_decode,
    )
    tracing.configure(args.otlp_traces_endpoint, f"tandem-{role}")
    return run_worker(engine_config_from_args(args), wcfg)


run_prefill = partial(run, "prefill")
run_decode = partial(run, "decode")
run_colocated = partial(run, "colocated")
