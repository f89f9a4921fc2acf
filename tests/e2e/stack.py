"""Start a real Tandem deployment (`tandem up`) for a test and talk to it over gRPC and /metrics."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import warnings
from collections import deque
from pathlib import Path

import grpc

from tandem.v1 import generation_pb2, generation_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
# The deployments' internal secret, known to the tests so that extra services (a second router or
# gateway next to a stack) and the tests themselves can reach the workers, as an operator's would.
INTERNAL_TOKEN = "tandem-e2e-internal-token-0123456789"


# What a caller of a worker's internal gRPC sends (the router's client interceptor does the same).
INTERNAL_METADATA = (("tandem-internal-token", INTERNAL_TOKEN),)


def service_env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", TANDEM_INTERNAL_TOKEN=INTERNAL_TOKEN)


class Stack:
    """`gateway=True` also starts the HTTP gateway on a free port (its URL is `self.gateway_url`).
    Local prefill on decode workers is off unless `args` turn it on: the tests' prompts are short,
    and they are here to exercise the prefill -> decode transfer.
    `env`: the launcher's environment (default: this one with the tests' INTERNAL_TOKEN).
    `launcher`: how `tandem` is started (default: this Python's `-P -m tandem.cli`); `cwd`: where
    (default: the checkout)."""

    def __init__(self, *args: str, timeout_s: float = 180.0, gateway: bool = False, env: dict | None = None,
                 launcher: list[str] | None = None, cwd: Path = ROOT):
        env = service_env() if env is None else env
        gateway_port = "0" if gateway else "-1"
        launcher = launcher or [sys.executable, "-P", "-m", "tandem.cli"]
        self.proc = subprocess.Popen(
            [*launcher, "up", "--port", "0", "--gateway-port", gateway_port, "--quiet",
             "--ready-json", "--local-prefill-max-tokens", "-1", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env,
            start_new_session=True,
        )
        self.log: deque[str] = deque(maxlen=400)
        self.info: dict | None = None
        ready = threading.Event()

        def pump() -> None:
            for line in self.proc.stdout:
                self.log.append(line.rstrip())
                at = line.find("TANDEM_UP ")
                if at >= 0 and self.info is None:
                    self.info = json.loads(line[at + len("TANDEM_UP "):])
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(timeout_s) or self.info is None:
            self.close()
            raise RuntimeError("stack did not come up:\n" + "\n".join(self.log))
        self.channel = grpc.insecure_channel(self.info["router"])
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    @property
    def gateway_url(self) -> str:
        return self.info["gateway"]

    def workers(self, role: str) -> list[dict]:
        return [w for w in self.info["workers"] if w["role"] == role]

    def generate(self, prompt: list[int] | str, timeout: float = 60.0, **sampling) -> generation_pb2.GenerateResponse:
        """The whole generation merged into one response (token ids, text, last chunk's fields). Greedy
        unless `sampling` says otherwise (an unset temperature would sample, as on every API)."""
        sampling.setdefault("temperature", 0.0)
        req = generation_pb2.GenerateRequest(sampling=generation_pb2.SamplingParams(**sampling))
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        merged = generation_pb2.GenerateResponse()
        for chunk in self.stub.Generate(req, timeout=timeout):
            merged.token_ids.extend(chunk.token_ids)
            merged.text += chunk.text
            merged.finish_reason = chunk.finish_reason
            if chunk.HasField("usage"):
                merged.usage.CopyFrom(chunk.usage)
        return merged

    def kv_pages(self, worker: dict) -> tuple[float, float]:
        """(free, total) KV pages from a worker's /metrics."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{worker['metrics_port']}/metrics", timeout=5).read().decode()
        free = float(re.search(r'tandem_kv_pages\{state="free"\} (\S+)', text).group(1))
        total = float(re.search(r'tandem_kv_pages\{state="total"\} (\S+)', text).group(1))
        return free, total

    def worker_requests(self, worker: dict) -> dict[str, float]:
        """A worker's finished requests by outcome (success, cancelled, failed) from its /metrics."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{worker['metrics_port']}/metrics", timeout=5).read().decode()
        return {m.group(1): float(m.group(2))
                for m in re.finditer(r'tandem_worker_requests_total\{outcome="(\w+)"\} (\S+)', text)}

    def metric(self, worker: dict, name: str) -> float:
        """One unlabelled sample of a worker's /metrics (0 when absent)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{worker['metrics_port']}/metrics", timeout=5).read().decode()
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        return float(m.group(1)) if m else 0.0

    def wait_pages_free(self, worker: dict, timeout_s: float = 15.0) -> tuple[float, float]:
        deadline = time.monotonic() + timeout_s
        while True:
            free, total = self.kv_pages(worker)
            if free == total or time.monotonic() > deadline:
                return free, total
            time.sleep(0.2)

    def close(self) -> None:
        """Stop the deployment; fails if a graceful stop left a worker's shared memory behind (a
        killed one's is removed here, as the next worker would)."""
        if getattr(self, "channel", None) is not None:
            self.channel.close()
        killed = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                killed = True
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        leaked = shm_segments_of(self.proc.pid)
        for path in leaked:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        tail = "\n".join(list(self.log)[-60:])     # whose stop was slow, or killed: the launcher logs it
        assert killed or not leaked, f"`tandem up` stopped but left shared memory behind: {leaked}\n{tail}"
        # A service the launcher had to SIGKILL left nothing behind (checked above), but its stop hung:
        # a bug seen once in CI (a decode worker, 2026-12-05) and not reproduced since. The launcher
        # logged where its threads were: shown in the test report's warnings, not failed on, until
        # that stack says what hangs.
        stuck = [i for i, line in enumerate(self.log) if "did not stop within" in line]
        if stuck:
            lines = list(self.log)   # what the services said while stopping, then the launcher's report
            warnings.warn("a service did not stop gracefully:\n" + "\n".join(lines[max(0, stuck[0] - 30):]), stacklevel=2)


def shm_segments_of(launcher_pid: int) -> list[str]:
    """KV segments of the workers a `tandem up` started (their ids end with the launcher's pid)."""
    return glob.glob(f"/dev/shm/tandem-kv-*_{launcher_pid}-*")


# ---- sharing one deployment between test modules, and extra services next to it ------------------

_SHARED: dict[tuple, Stack] = {}
API_KEY = "sk-tandem-test"


def shared_stack(config, *args: str, gateway: bool = False) -> Stack:
    """One Stack per argument list for the whole pytest session (closed when it ends), so modules
    that can share a deployment start it once. `config` is pytest's (request.config)."""
    key = (*args, gateway)
    stack = _SHARED.get(key)
    if stack is None or stack.proc.poll() is not None:
        stack = _SHARED[key] = Stack(*args, gateway=gateway)
        config.add_cleanup(stack.close)
    return stack


def gateway_stack(config, model: Path) -> Stack:
    """The 1P1D deployment with the HTTP gateway (API key `API_KEY`) that the gateway and SDK e2e
    tests share: a tiny model, fp32, 4-token pages."""
    return shared_stack(config, "--model", str(model), "--dtype", "float32", "--page-size", "4",
                        "--max-total-tokens", "4096", "--api-key", API_KEY, gateway=True)


class Service:
    """One more Tandem process (`python -m MODULE ARGS`, e.g. a second router or gateway), ready once
    it printed its TANDEM_READY line; `info` is that line's JSON."""

    def __init__(self, *argv: str):
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True,
                                     env=service_env())
        self.log: deque[str] = deque(maxlen=200)
        self.info: dict | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line.rstrip())
            if line.startswith("TANDEM_READY ") and self.info is None:
                self.info = json.loads(line[len("TANDEM_READY "):])
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout_s: float = 60.0) -> dict:
        if not self._ready.wait(timeout_s) or self.info is None:
            self.close()
            raise RuntimeError("service did not come up:\n" + "\n".join(self.log))
        return self.info

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
