"""What each process `tandem up` starts receives, for representative `tandem up` command lines: the
same as before the flags were declared once (the expected command lines below are what
tandem/up_cmd.py built by hand then, captured from that code). Compared as the child parses them
(its Namespace): a flag the user did not change may now be left to the child's own default."""

from __future__ import annotations

import os
import shlex
from typing import NamedTuple

import pytest

from tandem.cli.main import build_parser
from tandem.cli.up_cmd import child_argv, up_config
from tandem.services.common.flags import Owner
from tandem.services.launcher.up import gateway_argv, router_argv, worker_argv, worker_threads


class Case(NamedTuple):
    up: str
    worker: str
    router: str
    gateway: str | None   # None: no gateway (--gateway-port -1)
    api_key: str | None   # what the router and the gateway get in their environment


# Placeholders: REDIS (the registry's URL), WID (the worker's id), ROUTER (the router's address).
CASES = {
    "defaults": Case(
        up='up',
        worker='--model smollm2-135m --dtype auto --device auto --attention-backend auto --page-size 16 '
               '--kv-cache-gb 1.0 --max-running-requests 64 --chunked-prefill-size 2048 --mixed-chunk-itl-factor 1.5 '
               '--mixed-chunk-ttft-target 1.5 --prefill-schedule-policy shortest-first --prefill-max-wait 2.0 '
               '--max-queued-requests 4096 --priority-preemption-threshold 10 --speculative-num-draft-tokens 4 '
               '--speculative-ngram-min 2 --speculative-ngram-max 4 --bootstrap-timeout 30.0 --transfer-timeout 30.0 '
               '--log-stats-interval 5.0 --peer-probe-interval 1.0 --host 127.0.0.1 --port 0 --redis-url REDIS '
               '--worker-id WID --transfer-backend auto',
        router='--host 127.0.0.1 --port 50051 --redis-url REDIS --mode disagg --policy cache_aware --metrics-port 0 '
               '--retry-max-retries 1 --cb-failure-threshold 3 --cb-timeout-duration-secs 5.0 --max-request-bytes '
               '8388608 --max-input-tokens 0 --max-output-tokens 0 --max-stop-sequences 16 --max-stop-length 512',
        gateway='--host 127.0.0.1 --port 8000 --router ROUTER --max-request-bytes 8388608 --max-input-tokens 0 '
                '--max-output-tokens 0 --max-stop-sequences 16 --max-stop-length 512',
        api_key=None),
    "colocated": Case(
        up='up --mode colocated --colocated 2 --policy round_robin --host 0.0.0.0 --port 0 --transfer-backend '
           'tcp',
        worker='--model smollm2-135m --dtype auto --device auto --attention-backend auto --page-size 16 '
               '--kv-cache-gb 1.0 --max-running-requests 64 --chunked-prefill-size 2048 --mixed-chunk-itl-factor 1.5 '
               '--mixed-chunk-ttft-target 1.5 --prefill-schedule-policy shortest-first --prefill-max-wait 2.0 '
               '--max-queued-requests 4096 --priority-preemption-threshold 10 --speculative-num-draft-tokens 4 '
               '--speculative-ngram-min 2 --speculative-ngram-max 4 --bootstrap-timeout 30.0 --transfer-timeout 30.0 '
               '--log-stats-interval 5.0 --peer-probe-interval 1.0 --host 0.0.0.0 --port 0 --redis-url REDIS '
               '--worker-id WID --transfer-backend tcp',
        router='--host 0.0.0.0 --port 0 --redis-url REDIS --mode colocated --policy round_robin --metrics-port 0 '
               '--retry-max-retries 1 --cb-failure-threshold 3 --cb-timeout-duration-secs 5.0 --max-request-bytes '
               '8388608 --max-input-tokens 0 --max-output-tokens 0 --max-stop-sequences 16 --max-stop-length 512',
        gateway='--host 0.0.0.0 --port 8000 --router ROUTER --max-request-bytes 8388608 --max-input-tokens 0 '
                '--max-output-tokens 0 --max-stop-sequences 16 --max-stop-length 512',
        api_key=None),
    "everything": Case(
        up='up --bootstrap-timeout 5 --transfer-timeout 7 --drain-timeout 3 --watchdog-timeout 9 --require-rdma '
           '--max-inflight 7 --max-queued-requests 5 --enable-priority-scheduling --low-priority-values-first '
           '--retry-max-retries 2 --disable-circuit-breaker --cb-failure-threshold 4 --cb-timeout-duration-secs '
           '2.5 --internal-token-file /t --tls-cert a --tls-key b --tls-ca c --max-input-tokens 100 '
           '--max-request-bytes 4096 --fault-inject forward_delay_ms=1 --enable-fault-injection --profile-dir /p '
           '--step-trace-dir /s --log-stats-interval 0 --peer-probe-interval 0.5 --local-prefill-max-tokens -1 '
           '--balance-rel-threshold 2 --model /m --dtype float32 --num-threads 1 --enable-graph --graph-bs 2,1 '
           '--disable-prefix-cache --speculative-algorithm ngram --disable-speculative-adaptive',
        worker='--model /m --dtype float32 --device auto --attention-backend auto --page-size 16 --kv-cache-gb 1.0 '
               '--disable-prefix-cache --max-running-requests 64 --chunked-prefill-size 2048 '
               '--mixed-chunk-itl-factor 1.5 --mixed-chunk-ttft-target 1.5 --prefill-schedule-policy shortest-first '
               '--prefill-max-wait 2.0 --max-queued-requests 5 --enable-priority-scheduling '
               '--low-priority-values-first --priority-preemption-threshold 10 --num-threads 1 --enable-graph '
               '--graph-bs 1,2 --speculative-algorithm ngram --speculative-num-draft-tokens 4 '
               '--speculative-ngram-min 2 --speculative-ngram-max 4 --disable-speculative-adaptive '
               '--bootstrap-timeout 5.0 --transfer-timeout 7.0 --watchdog-timeout 9.0 --drain-timeout 3.0 '
               '--require-rdma --log-stats-interval 0.0 --internal-token-file /t --tls-cert a --tls-key b --tls-ca c '
               '--profile-dir /p --step-trace-dir /s --peer-probe-interval 0.5 --fault-inject forward_delay_ms=1 '
               '--enable-fault-injection --host 127.0.0.1 --port 0 --redis-url REDIS --worker-id WID '
               '--transfer-backend auto',
        router='--host 127.0.0.1 --port 50051 --redis-url REDIS --mode disagg --policy cache_aware --metrics-port 0 '
               '--max-inflight 7 --max-queued-requests 5 --retry-max-retries 2 --cb-failure-threshold 4 '
               '--cb-timeout-duration-secs 2.5 --disable-circuit-breaker --enable-priority-scheduling '
               '--low-priority-values-first --local-prefill-max-tokens -1 --balance-rel-threshold 2.0 '
               '--internal-token-file /t --tls-cert a --tls-key b --tls-ca c --max-request-bytes 4096 '
               '--max-input-tokens 100 --max-output-tokens 0 --max-stop-sequences 16 --max-stop-length 512',
        gateway='--host 127.0.0.1 --port 8000 --router ROUTER --internal-token-file /t --max-request-bytes 4096 '
                '--max-input-tokens 100 --max-output-tokens 0 --max-stop-sequences 16 --max-stop-length 512',
        api_key=None),
    "gateway_off_key": Case(
        up='up --api-key sk-1 --gateway-port -1 --redis-url redis://x:1/0 --cpu-cores none --max-queued-requests '
           '1024 --policy least_load',
        worker='--model smollm2-135m --dtype auto --device auto --attention-backend auto --page-size 16 '
               '--kv-cache-gb 1.0 --max-running-requests 64 --chunked-prefill-size 2048 --mixed-chunk-itl-factor 1.5 '
               '--mixed-chunk-ttft-target 1.5 --prefill-schedule-policy shortest-first --prefill-max-wait 2.0 '
               '--max-queued-requests 1024 --priority-preemption-threshold 10 --speculative-num-draft-tokens 4 '
               '--speculative-ngram-min 2 --speculative-ngram-max 4 --bootstrap-timeout 30.0 --transfer-timeout 30.0 '
               '--log-stats-interval 5.0 --peer-probe-interval 1.0 --host 127.0.0.1 --port 0 --redis-url REDIS '
               '--worker-id WID --transfer-backend auto',
        router='--host 127.0.0.1 --port 50051 --redis-url REDIS --mode disagg --policy least_load --metrics-port 0 '
               '--max-queued-requests 1024 --retry-max-retries 1 --cb-failure-threshold 3 --cb-timeout-duration-secs '
               '5.0 --max-request-bytes 8388608 --max-input-tokens 0 --max-output-tokens 0 --max-stop-sequences 16 '
               '--max-stop-length 512',
        gateway=None,
        api_key='sk-1'),
    "defaults_given": Case(
        up='up --bootstrap-timeout 30 --transfer-timeout 30.0 --drain-timeout 10 --watchdog-timeout 300 --mode '
           'disagg --transfer-backend auto --max-inflight 1024',
        worker='--model smollm2-135m --dtype auto --device auto --attention-backend auto --page-size 16 '
               '--kv-cache-gb 1.0 --max-running-requests 64 --chunked-prefill-size 2048 --mixed-chunk-itl-factor 1.5 '
               '--mixed-chunk-ttft-target 1.5 --prefill-schedule-policy shortest-first --prefill-max-wait 2.0 '
               '--max-queued-requests 4096 --priority-preemption-threshold 10 --speculative-num-draft-tokens 4 '
               '--speculative-ngram-min 2 --speculative-ngram-max 4 --bootstrap-timeout 30.0 --transfer-timeout 30.0 '
               '--watchdog-timeout 300.0 --drain-timeout 10.0 --log-stats-interval 5.0 --peer-probe-interval 1.0 '
               '--host 127.0.0.1 --port 0 --redis-url REDIS --worker-id WID --transfer-backend auto',
        router='--host 127.0.0.1 --port 50051 --redis-url REDIS --mode disagg --policy cache_aware --metrics-port 0 '
               '--max-inflight 1024 --retry-max-retries 1 --cb-failure-threshold 3 --cb-timeout-duration-secs 5.0 '
               '--max-request-bytes 8388608 --max-input-tokens 0 --max-output-tokens 0 --max-stop-sequences 16 '
               '--max-stop-length 512',
        gateway='--host 127.0.0.1 --port 8000 --router ROUTER --max-request-bytes 8388608 --max-input-tokens 0 '
                '--max-output-tokens 0 --max-stop-sequences 16 --max-stop-length 512',
        api_key=None),
}


def _parsed(argv: list[str]) -> dict:
    return vars(build_parser().parse_args(argv))


@pytest.fixture(autouse=True)
def _four_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 4)


@pytest.mark.parametrize("name", CASES)
def test_each_child_gets_what_it_got_before(name):
    case = CASES[name]
    cfg = up_config(build_parser().parse_args(shlex.split(case.up)))
    role = "colocated" if cfg.mode == "colocated" else "prefill"
    before = shlex.split(case.worker.replace("WID", f"{role}-0-{os.getpid()}"))
    if "--num-threads" not in before:    # the launcher's share of the cores, as before
        before += ["--num-threads", str(worker_threads(cfg))]
    assert _parsed(worker_argv(cfg, role, f"{role}-0", "REDIS", None)) == _parsed([role, *before])
    assert _parsed(router_argv(cfg, cfg.port, "REDIS")) == _parsed(["router", *shlex.split(case.router)])
    if case.gateway is None:
        assert cfg.gateway_port == -1
    else:
        assert _parsed(["gateway", *gateway_argv(cfg, cfg.gateway_port, "ROUTER")]) == \
            _parsed(["gateway", *shlex.split(case.gateway)])
    assert cfg.api_key == case.api_key


def test_only_what_the_user_set_is_forwarded():
    up = build_parser().parse_args(["up"])
    assert child_argv(up, Owner.ENGINE | Owner.WORKER) == []
    assert child_argv(up, Owner.ROUTER) == [] and child_argv(up, Owner.GATEWAY) == []
    up = build_parser().parse_args(["up", "--drain-timeout", "3", "--max-inflight", "7", "--request-timeout", "9",
                                    "--max-n", "2", "--host", "0.0.0.0", "--mode", "colocated",
                                    "--max-queued-requests", "5"])
    assert child_argv(up, Owner.ENGINE | Owner.WORKER) == ["--host", "0.0.0.0", "--max-queued-requests", "5",
                                                           "--drain-timeout", "3.0"]
    # --drain-timeout is the workers' and --max-inflight the router's (as `tandem up --help` says).
    assert child_argv(up, Owner.ROUTER) == ["--mode", "colocated", "--host", "0.0.0.0", "--max-queued-requests", "5",
                                            "--max-inflight", "7", "--request-timeout", "9.0"]
    assert child_argv(up, Owner.GATEWAY) == ["--host", "0.0.0.0", "--request-timeout", "9.0", "--max-n", "2"]


def test_a_pinned_worker_gets_its_cores_and_no_thread_count():
    cfg = up_config(build_parser().parse_args(["up"]))
    argv = worker_argv(cfg, "decode", "decode-0", "REDIS", (2, 3))
    assert argv[0] == "decode" and argv[argv.index("--cpu-cores") + 1] == "2-3" and "--num-threads" not in argv
    given = up_config(build_parser().parse_args(["up", "--num-threads", "3"]))
    assert _parsed(worker_argv(given, "decode", "decode-0", "REDIS", None))["num_threads"] == 3


def test_the_router_queue_timeout_is_a_flag_of_up_given_to_the_router_only():
    up = build_parser().parse_args(["up", "--max-queued-requests", "8", "--queue-timeout-secs", "2.5"])
    assert child_argv(up, Owner.ROUTER) == ["--max-queued-requests", "8", "--queue-timeout-secs", "2.5"]
    assert "--queue-timeout-secs" not in child_argv(up, Owner.ENGINE | Owner.WORKER)
    assert "--queue-timeout-secs" not in child_argv(up, Owner.GATEWAY)
    router = _parsed(["router", "--redis-url", "redis://x:1/0", *child_argv(up, Owner.ROUTER)])
    assert router["queue_timeout_secs"] == 2.5
