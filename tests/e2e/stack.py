"""Start a real Tandem deployment (`tandem up`) for a test and talk to it over gRPC and /metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path

import grpc

from tandem.v1 import generation_pb2, generation_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


class Stack:
    def __init__(self, *args: str, timeout_s: float = 180.0):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "up", "--port", "0", "--quiet", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
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

    def workers(self, role: str) -> list[dict]:
        return [w for w in self.info["workers"] if w["role"] == role]

    def generate(self, prompt: list[int] | str, timeout: float = 60.0, **sampling) -> generation_pb2.GenerateResponse:
        """The whole generation merged into one response (token ids, text, last chunk's fields)."""
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

    def wait_pages_free(self, worker: dict, timeout_s: float = 15.0) -> tuple[float, float]:
        deadline = time.monotonic() + timeout_s
        while True:
            free, total = self.kv_pages(worker)
            if free == total or time.monotonic() > deadline:
                return free, total
            time.sleep(0.2)

    def close(self) -> None:
        if getattr(self, "channel", None) is not None:
            self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
