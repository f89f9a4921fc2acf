"""Start a whole Tandem deployment on this machine and keep it running until Ctrl-C / SIGTERM."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass

from services.launcher.procs import Child, python_cmd, stop_all
from services.launcher.redis_server import EmbeddedRedis

API_KEY_ENV = "TANDEM_API_KEY"  # what the gateway reads (services/gateway/config.py)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpConfig:
    mode: str = "disagg"                 # disagg | colocated
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    port: int = 50051                    # router's public gRPC port (0: any free port)
    redis_url: str | None = None         # None: embedded redis-server
    transfer_backend: str = "auto"
    policy: str = "round_robin"
    worker_args: tuple[str, ...] = ()    # engine flags forwarded to every worker
    router_args: tuple[str, ...] = ()
    ready_timeout_s: float = 600.0       # first run imports the default model
    quiet: bool = False
    gateway_port: int = 8000             # OpenAI-compatible HTTP gateway (0: any free port, -1: none)
    gateway_args: tuple[str, ...] = ()
    api_key: str | None = None           # the gateway's key (passed in its environment, not its argv)


def _printer(quiet: bool):
    lock = threading.Lock()

    def on_line(name: str, line: str) -> None:
        if quiet and not line.startswith("TANDEM_READY"):
            return
        with lock:  # one write per line: print() writes text and newline separately
            sys.stderr.write(f"[{name}] {line}\n")
            sys.stderr.flush()
    return on_line


def worker_threads(cfg: UpConfig) -> int:
    """Split the machine's cores between the workers (oversubscribed torch threads spin and crawl)."""
    workers = 1 if cfg.mode == "colocated" else cfg.num_prefill + cfg.num_decode
    return max(1, (os.cpu_count() or 1) // workers)


def run_up(cfg: UpConfig) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    on_line = _printer(cfg.quiet)
    redis = None
    workers: list[Child] = []
    router: Child | None = None
    gateway: Child | None = None
    try:
        url = cfg.redis_url
        if url is None:
            redis = EmbeddedRedis()
            redis.start()
            url = redis.url
        roles = [("colocated", 1)] if cfg.mode == "colocated" else [("prefill", cfg.num_prefill), ("decode", cfg.num_decode)]
        threads = ["--num-threads", str(worker_threads(cfg))] if "--num-threads" not in cfg.worker_args else []
        for role, n in roles:
            for i in range(n):
                name = f"{role}-{i}"
                argv = python_cmd(role, *cfg.worker_args, *threads, "--host", cfg.host, "--port", "0",
                                  "--redis-url", url, "--worker-id", f"{name}-{os.getpid()}",
                                  "--transfer-backend", cfg.transfer_backend)
                workers.append(Child(name, argv, on_line=on_line))
        for w in workers:
            w.start()
        ready = [w.wait_ready(cfg.ready_timeout_s) for w in workers]
        router = Child("router", python_cmd(
            "router", "--host", cfg.host, "--port", str(cfg.port), "--redis-url", url, "--mode", cfg.mode,
            "--policy", cfg.policy, "--metrics-port", "0", *cfg.router_args), on_line=on_line)
        router.start()
        router_ready = router.wait_ready(60.0)
        summary = {"router": router_ready["grpc_addr"], "mode": cfg.mode, "redis_url": url, "workers": ready,
                   "router_metrics_port": router_ready.get("metrics_port")}
        if cfg.gateway_port >= 0:
            # Started as a module, so it needs nothing from the `tandem` command's subcommand table.
            gateway = Child("gateway", [sys.executable, "-m", "services.gateway", "--host", cfg.host,
                                        "--port", str(cfg.gateway_port), "--router", router_ready["grpc_addr"],
                                        *cfg.gateway_args], env=_gateway_env(cfg), on_line=on_line)
            gateway.start()
            summary["gateway"] = gateway.wait_ready(60.0)["url"]
        sys.stdout.write("TANDEM_UP " + json.dumps(summary) + "\n")
        sys.stdout.flush()
        if not cfg.quiet:
            print(_banner(summary, _auth_header(cfg)), file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            if not router.alive:
                log.error("router exited (code %s): shutting down", router.proc.returncode)
                return 1
            if gateway is not None and not gateway.alive:
                log.error("gateway exited (code %s): shutting down", gateway.proc.returncode)
                return 1
            for w in workers:
                if not w.alive and w.ready is not None and not getattr(w, "_reported", False):
                    w._reported = True
                    log.warning("%s exited (code %s); the rest keep serving", w.name, w.proc.returncode)
        return 0
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        stop_all([c for c in [gateway, router, *workers] if c is not None])
        if redis is not None:
            redis.close()


def _gateway_env(cfg: UpConfig) -> dict[str, str]:
    env = dict(os.environ)
    if cfg.api_key is not None:
        env[API_KEY_ENV] = cfg.api_key
    return env


def _auth_header(cfg: UpConfig) -> str:
    if cfg.api_key is not None:
        return " -H 'Authorization: Bearer <your --api-key>'"
    if os.environ.get(API_KEY_ENV):
        return f" -H \"Authorization: Bearer ${API_KEY_ENV}\""
    return ""


def _banner(summary: dict, auth: str = "") -> str:
    addr = summary["router"]
    lines = [
        f"Tandem is up ({summary['mode']}): gRPC tandem.v1.Generation on {addr}",
        *(f"  {w['role']:9s} {w['worker_id']} at {w['grpc_addr']} (metrics :{w['metrics_port']})"
          for w in summary["workers"]),
        "Try it with the gRPC SDK:",
        "  .venv/bin/python -c \"from tandem_client import Client; "
        f"print(Client('{addr}').generate('The capital of France is', max_tokens=16).text)\"",
    ]
    if "gateway" in summary:
        url = summary["gateway"]
        lines[1:1] = [f"  gateway   OpenAI-compatible HTTP API on {url}/v1"]
        lines += [
            "or over HTTP (OpenAI API):",
            f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\",
            "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], "
            "\"max_tokens\": 32}'",
        ]
    lines.append("Ctrl-C stops everything.")
    return "\n".join(lines)
