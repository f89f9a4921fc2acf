"""`tandem router` as a process: flags, the TANDEM_READY line, graceful stop on SIGTERM."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys

import pytest

from tandem.cli import router_cmd
from tandem.services.router.config import RouterConfig, add_arguments


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    router_cmd.add_arguments(p)
    return p.parse_args(argv)


def test_flags_build_the_config():
    c = RouterConfig.from_args(
        _parse("--port", "0", "--prefill", "a:1,b:1", "--prefill", "c:1", "--decode", "d:1", "--policy", "least_load",
               "--max-inflight", "7", "--request-timeout", "30", "--metrics-port", "0")
    )
    assert c.prefill == ("a:1", "b:1", "c:1") and c.decode == ("d:1",)
    assert (c.policy, c.mode, c.max_inflight, c.request_timeout_s, c.metrics_port) == ("least_load", "disagg", 7, 30.0, 0)
    assert RouterConfig.from_args(_parse("--redis-url", "redis://h:6379/0")).redis_url == "redis://h:6379/0"


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        ((), "no registry"),
        (("--redis-url", "redis://x", "--prefill", "a:1"), "not both"),
        (("--prefill", "a:1"), "--mode disagg needs"),
        (("--mode", "colocated", "--prefill", "a:1", "--decode", "b:1"), "--mode colocated needs"),
        (("--redis-url", "redis://x", "--max-inflight", "0"), "max-inflight"),
        (("--redis-url", "redis://x", "--local-prefill-max-tokens", "-2"), "local-prefill-max-tokens"),
        (("--redis-url", "redis://x", "--max-prefill-queue-tokens", "-1"), "max-prefill-queue-tokens"),
        (("--redis-url", "redis://x", "--balance-rel-threshold", "0.5"), "balance-rel-threshold"),
        (("--redis-url", "redis://x", "--prefix-cache-ttl", "0"), "prefix-cache-ttl"),
    ],
)
def test_bad_flag_combinations(argv, match):
    with pytest.raises(ValueError, match=match):
        RouterConfig.from_args(_parse(*argv))


def test_module_does_not_import_torch():
    code = "import sys, tandem.cli.router_cmd, tandem.services.router.server; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_process_prints_ready_and_stops_on_sigterm():
    argv = [sys.executable, "-P", "-m", "tandem.services.router", "--port", "0", "--prefill", "127.0.0.1:1", "--decode",
            "127.0.0.1:2", "--probe-interval", "0", "--drain-timeout", "0.5"]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            line = proc.stdout.readline()
            assert line.startswith("TANDEM_READY "), line + proc.stderr.read()
            ready = json.loads(line.removeprefix("TANDEM_READY "))
            assert ready["role"] == "router" and ready["grpc_addr"].startswith("127.0.0.1:")
            assert int(ready["grpc_addr"].rsplit(":", 1)[1]) > 0
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
            assert proc.stdout.read() == ""  # exactly one line on stdout
        finally:
            if proc.poll() is None:
                proc.kill()


def test_process_exits_2_on_bad_flags():
    out = subprocess.run([sys.executable, "-P", "-m", "tandem.services.router", "--port", "0"], capture_output=True, text=True)
    assert out.returncode == 2 and "no registry" in out.stderr


def test_add_arguments_is_shared():
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--redis-url", "redis://x"]).port == 50051
