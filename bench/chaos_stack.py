"""The deployment a chaos run works on: `tandem up` as a child, its processes' pids as they restart,
and each worker's KV pages and idle self-check from /metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.request

from tandem.bench.serve.procs import UP_PREFIX, start_tandem_up

RESTARTED_PREFIX = "TANDEM_RESTARTED "


class ChaosStack:
    """`tandem up --ready-json` (2P2D by default); `pids[name]` and `workers[name]` follow restarts."""

    def __init__(self, args: list[str], timeout_s: float = 600.0):
        self.pids: dict[str, int] = {}
        self.workers: dict[str, dict] = {}            # name (prefill-0) -> its latest READY JSON
        self.router_metrics_port: int | None = None
        self.restarted: dict[str, threading.Event] = {}
        self.back_at: dict[str, float] = {}                # name -> when its restarted instance was ready
        self._lock = threading.Lock()
        self._proc, self.info = start_tandem_up(["--port", "0", "--gateway-port", "0", "--quiet", *args],
                                                timeout_s, on_line=self._on_line)

    def _on_line(self, line: str) -> None:
        """On the output thread, in order: the summary line, then each restart."""
        if line.startswith(UP_PREFIX):
            info = json.loads(line[len(UP_PREFIX):])
            with self._lock:
                self.router_metrics_port = info.get("router_metrics_port")
                self.pids = dict(info["pids"])
                self.workers = {_name(w): w for w in info["workers"]}
            return
        if not line.startswith(RESTARTED_PREFIX):
            return
        event = json.loads(line[len(RESTARTED_PREFIX):])
        with self._lock:
            self.pids[event["name"]] = event["pid"]
            if event["ready"].get("role") in ("prefill", "decode", "colocated"):
                self.workers[event["name"]] = event["ready"]
            elif event["name"] == "router":
                self.router_metrics_port = event["ready"].get("metrics_port")
            self.back_at[event["name"]] = time.monotonic()
            self.restarted.setdefault(event["name"], threading.Event()).set()

    @property
    def gateway(self) -> str:
        return self.info["gateway"]

    def kill(self, name: str) -> None:
        with self._lock:
            self.restarted[name] = threading.Event()
            pid = self.pids[name]
        os.kill(pid, signal.SIGKILL)

    def wait_restarted(self, name: str, timeout_s: float) -> bool:
        return self.restarted.get(name, threading.Event()).wait(timeout_s)

    def kv(self) -> dict[str, dict]:
        """Per worker: free and total KV pages, idle self-check failures (None if /metrics is down)."""
        with self._lock:
            workers = dict(self.workers)
        out = {}
        for name, w in workers.items():
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{w['metrics_port']}/metrics", timeout=5).read().decode()
            except OSError:
                out[name] = None
                continue
            out[name] = {"free": _sample(text, 'tandem_kv_pages{state="free"}'),
                         "total": _sample(text, 'tandem_kv_pages{state="total"}'),
                         "idle_check_failures": _sample(text, "tandem_idle_check_failures_total")}
        return out

    def router_retries(self) -> float | None:
        """The router's retries counter (it restarts from 0 with the router); None if unreadable."""
        return self.router_metric("tandem_router_retries_total")

    def router_metric(self, name: str) -> float | None:
        """One sample of the router's /metrics (0 when absent); None if unreadable."""
        try:
            url = f"http://127.0.0.1:{self.router_metrics_port}/metrics"
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except (OSError, TypeError):
            return None
        return _sample(text, name)

    def wait_idle(self, timeout_s: float = 20.0) -> dict[str, dict]:
        """Poll until every worker shows free == total pages (or the timeout), then report."""
        deadline = time.monotonic() + timeout_s
        while True:
            kv = self.kv()
            if all(v is not None and v["free"] == v["total"] for v in kv.values()) or time.monotonic() > deadline:
                return kv
            time.sleep(0.5)

    def close(self) -> None:
        self._proc.stop(60.0)


def _name(worker: dict) -> str:
    # worker ids are NAME-<launcher pid> (services/launcher/up.py)
    return worker["worker_id"].rsplit("-", 1)[0]


def _sample(text: str, name: str) -> float:
    m = re.search("^" + re.escape(name) + r" (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0
