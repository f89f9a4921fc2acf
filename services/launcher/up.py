"""Start a whole Tandem deployment on this machine and keep it running until Ctrl-C / SIGTERM."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Callable

from tandem.services.common.auth import API_KEY_ENV, deployment_env  # the key the router and the gateway read
from tandem.services.common.auth import TOKEN_ENV as INTERNAL_TOKEN_ENV
from tandem.services.common.cpu_cores import (
    CpuListError,
    available_cores,
    describe,
    format_cpu_list,
    pin,
    plan_cores,
)
from tandem.services.launcher.config import UpConfig
from tandem.services.launcher.procs import READY_PREFIX, Child, niced, python_cmd, stop_all
from tandem.services.launcher.redis_server import EmbeddedRedis
from tandem.services.launcher.reshape import Reshaper
from tandem.services.launcher.shaping import reshaper, start_planner
from tandem.services.launcher.supervisor import Supervisor

# With `ready_json`, the one stdout line scripts and tests wait for: this prefix, then the summary JSON.
READY_JSON_PREFIX = "TANDEM_UP "
# With `ready_json`, one line per restarted process once it is ready again: this prefix, then
# {"name", "restarts", "pid", "ready"} (the process's own READY JSON; {} for Redis).
RESTARTED_JSON_PREFIX = "TANDEM_RESTARTED "

log = logging.getLogger(__name__)


# A service's log record starts `2026-12-05 09:12:33,739 LEVEL logger: message` (tandem/cli/command.py).
_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (\w+) ")
_LOUD = {"WARNING", "ERROR", "CRITICAL"}


def _printer(quiet: bool):
    """Prefixes each service's lines with its name. `quiet`: only their warnings and errors, each with
    the lines that continue it (a traceback, a stack dump), and what is not a log record at all
    (a crash's traceback), and the READY JSON."""
    lock = threading.Lock()
    loud: dict[str, bool] = {}   # per service: is the record being continued a warning or worse

    def on_line(name: str, line: str) -> None:
        if line.startswith(READY_PREFIX):
            if not quiet:   # the banner says where it listens; the JSON is for scripts
                line = "ready"
        elif quiet:
            m = _RECORD.match(line)
            if m is not None:
                loud[name] = m.group(1) in _LOUD
            if not loud.get(name, True):
                return
        with lock:  # one write per line: print() writes text and newline separately
            sys.stderr.write(f"[{name}] {line}\n")
            sys.stderr.flush()
    return on_line


def worker_roles(cfg: UpConfig) -> list[tuple[str, int]]:
    """(role, count) for every kind of worker this deployment starts."""
    if cfg.mode == "colocated":
        return [("colocated", cfg.num_colocated)]
    return [("prefill", cfg.num_prefill), ("decode", cfg.num_decode)]


def worker_threads(cfg: UpConfig) -> int:
    """Split the machine's cores between the workers (oversubscribed torch threads spin and crawl)."""
    workers = sum(n for _, n in worker_roles(cfg))
    return max(1, (os.cpu_count() or 1) // max(1, workers))


def worker_argv(cfg: UpConfig, role: str, name: str, url: str, cores: tuple[int, ...] | None) -> list[str]:
    """A worker's command line: the flags `tandem up` forwards, then where it runs (its cores, or its
    share of torch threads unless --num-threads was given; any free port; the registry; its id)."""
    if cores is not None:   # a pinned worker runs one torch thread per core of its own (unless --num-threads)
        placed = ["--cpu-cores", format_cpu_list(cores)]
    else:
        placed = ["--num-threads", str(worker_threads(cfg))] if "--num-threads" not in cfg.worker_args else []
    return [role, *cfg.worker_args, *placed, "--port", "0", "--redis-url", url, "--worker-id", f"{name}-{os.getpid()}"]


def router_argv(cfg: UpConfig, port: int, url: str) -> list[str]:
    """The router's: the flags `tandem up` forwards, then its port, the registry and a metrics port."""
    return ["router", *cfg.router_args, "--port", str(port), "--redis-url", url, "--metrics-port", "0"]


def gateway_argv(cfg: UpConfig, port: int, router_addr: str, redis_url: str | None = None) -> list[str]:
    """The gateway's (after `python -m tandem.services.gateway`): forwarded flags, its port, its router,
    and the deployment's Redis (its Responses API store)."""
    return [*cfg.gateway_args, "--port", str(port), "--router", router_addr,
            *(["--redis-url", redis_url] if redis_url else [])]


class _Interrupted(Exception):
    """SIGINT/SIGTERM arrived while the stack was still starting."""


def _wait_ready(child: Child, timeout_s: float, stop: threading.Event) -> dict:
    """The child's READY line; gives up at once when asked to stop."""
    deadline = time.monotonic() + timeout_s
    while not child.ready_event.wait(0.2):
        if stop.is_set():
            raise _Interrupted
        if time.monotonic() > deadline:
            break
    return child.wait_ready(0)


def _wait_healthy(what: str, probe, child: Child, timeout_s: float, stop: threading.Event) -> None:
    """Poll `probe()` until it is true: the service says it can serve (not just that it listens)."""
    deadline = time.monotonic() + timeout_s
    while not probe():
        if stop.is_set():
            raise _Interrupted
        if not child.alive:
            raise RuntimeError(f"{child.name} exited (code {child.proc.returncode}) before {what} was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} was not ready within {timeout_s:.0f}s")
        stop.wait(0.2)


def _gateway_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:       # connection refused, or HTTP 503 (urllib's HTTPError is an OSError)
        return False


def _router_healthy(addr: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(addr) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def run_up(cfg: UpConfig) -> int:
    stop = threading.Event()
    signals: list[str] = []

    def on_signal(signum: int, _frame) -> None:
        signals.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    on_line = _printer(cfg.quiet)
    say = (lambda _msg: None) if cfg.quiet else (lambda msg: print(msg, flush=True))
    redis = None
    workers: list[Child] = []
    router: Child | None = None
    gateway: Child | None = None
    planner: Child | None = None
    sup: Supervisor | None = None
    shaper: Reshaper | None = None
    up = False
    try:
        roles = worker_roles(cfg)
        names = [f"{role}-{i}" for role, n in roles for i in range(n)]
        try:
            plan = plan_cores(cfg.cpu_cores, available_cores(), len(names))
            if plan.services is not None:
                pin(plan.services)  # Redis, router and gateway start from here and inherit it
        except CpuListError as e:
            print(f"error: --cpu-cores: {e}", file=sys.stderr, flush=True)
            return 2
        # Services with no core of their own yield to the workers' forward passes (--services-nice).
        nice = plan.services_nice(cfg.services_nice)
        placement = describe(plan, names, nice)
        url = cfg.redis_url
        if url is None:
            redis = EmbeddedRedis(niceness=nice)
            redis.start()
            url = redis.url
        env = _children_env(cfg)
        for role, n in roles:
            for i in range(n):
                name = f"{role}-{i}"
                argv = python_cmd(*worker_argv(cfg, role, name, url, plan.workers[len(workers)]))
                workers.append(Child(name, argv, env=env, on_line=on_line))
        say(f"Starting Tandem ({cfg.mode}): {len(workers)} worker(s), router"
            + (", gateway" if cfg.gateway_port >= 0 else "") + " ...")
        say(f"CPU placement: {placement}")
        for w in workers:
            w.start()
        ready = [_wait_ready(w, cfg.ready_timeout_s, stop) for w in workers]
        def router_child(port: int) -> Child:
            return Child("router", niced(python_cmd(*router_argv(cfg, port, url)), nice), env=_router_env(cfg, env),
                         on_line=on_line)

        router = router_child(cfg.port)
        router.start()
        router_ready = _wait_ready(router, 60.0, stop)
        summary = {"router": router_ready["grpc_addr"], "mode": cfg.mode, "redis_url": url, "workers": ready,
                   "router_metrics_port": router_ready.get("metrics_port"), "cpu_placement": placement,
                   "cpu_cores": {**{n: format_cpu_list(c) if c else None for n, c in zip(names, plan.workers, strict=True)},
                                 "services": format_cpu_list(plan.services) if plan.services else None}}
        if cfg.gateway_port >= 0:
            # Started as a module, so it needs nothing from the `tandem` command's subcommand table.
            def gateway_child(port: int) -> Child:
                return Child("gateway", niced([sys.executable, "-P", "-m", "tandem.services.gateway",
                                               *gateway_argv(cfg, port, router_ready["grpc_addr"], url)], nice),
                             env=_router_env(cfg, env), on_line=on_line)

            gateway = gateway_child(cfg.gateway_port)
            gateway.start()
            summary["gateway"] = _wait_ready(gateway, 60.0, stop)["url"]
            # Up means a request would be served: the gateway's /health checks that the router
            # reaches workers of every role it needs.
            _wait_healthy("the gateway", lambda: _gateway_healthy(summary["gateway"]), gateway, 60.0, stop)
        else:
            _wait_healthy("the router", lambda: _router_healthy(summary["router"]), router, 60.0, stop)
        if cfg.planner:   # acts through Redis and reads the router's metrics: started once both answer
            planner = start_planner(cfg, url, summary["router_metrics_port"], env, on_line)
        up = True
        summary["pids"] = {c.name: c.proc.pid for c in [*workers, router, gateway, planner, redis and redis.child] if c}
        if cfg.ready_json:
            sys.stdout.write(READY_JSON_PREFIX + json.dumps(summary) + "\n")
            sys.stdout.flush()
        say(_banner(summary, cfg.host, _auth_header(cfg)))
        sup = _supervise(cfg, workers, router, router_child, _port_of(summary["router"]), gateway,
                         gateway_child if gateway is not None else None,
                         _port_of(summary.get("gateway", "")), redis)
        if planner is not None:
            sup.add("planner", planner, lambda: start_planner(cfg, url, summary["router_metrics_port"], env, on_line))
        shaper = reshaper(cfg, sup, names, plan.workers, url, lambda role, name, cores: Child(
            name, python_cmd(*worker_argv(cfg, role, name, url, cores)), env=env, on_line=on_line))
        if shaper is not None:
            shaper.poll()   # its state is in Redis at once: `tandem reshape` may follow TANDEM_UP right away
        while not stop.wait(0.5):
            sup.poll()
            if shaper is not None:
                shaper.poll()
            down = {"router", "gateway"} & {*sup.gave_up, *sup.stopped}
            if down:
                log.error("%s stays down: shutting down", " and ".join(sorted(down)))
                return 1
        return 0
    except _Interrupted:
        print(f"Interrupted ({signals[0]}) while starting.", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if sup is not None:   # the current instances, restarted ones included (Redis is closed below)
            gateway, router, planner = (sup.entries[n].child if n in sup.entries else None
                                        for n in ("gateway", "router", "planner"))
            workers = shaper.children() if shaper is not None else [sup.entries[w.name].child for w in workers]
        children = [c for c in [planner, gateway, router, *workers] if c is not None]
        if signals:
            say(f"\nStopping Tandem ({signals[0]}): letting in-flight requests finish "
                f"(up to {cfg.stop_grace_s:.0f}s) ...")
        stop_all(children, grace_s=cfg.stop_grace_s)
        if redis is not None:
            redis.close()
        if up and signals:
            say("Tandem stopped.")


def _port_of(addr: str) -> int:
    """The port of `host:port` or `http://host:port` (0 when there is none)."""
    tail = addr.rsplit(":", 1)[-1] if addr else ""
    return int(tail) if tail.isdigit() else 0


def _supervise(cfg: UpConfig, workers: list[Child], router: Child, router_child, router_port: int,
               gateway: Child | None, gateway_child, gateway_port: int, redis: EmbeddedRedis | None) -> Supervisor:
    """Everything `run_up` started, under a Supervisor: a restarted router or gateway gets the port its
    predecessor had (clients and the gateway keep their addresses); a worker keeps its flags and id."""
    def on_ready(name: str, restarts: int, ready: dict) -> None:
        pid = sup.entries[name].child.proc.pid
        if cfg.ready_json:
            line = json.dumps({"name": name, "restarts": restarts, "pid": pid, "ready": ready})
            sys.stdout.write(RESTARTED_JSON_PREFIX + line + "\n")
            sys.stdout.flush()

    def restart(make) -> Callable[[], Child]:
        def start() -> Child:
            child = make()
            child.start()
            return child
        return start

    sup = Supervisor(max_restarts=cfg.max_restarts, on_ready=on_ready)
    for w in workers:
        sup.add(w.name, w, restart(lambda w=w: Child(w.name, w.argv, env=w.env, on_line=w.on_line)))
    sup.add("router", router, restart(lambda: router_child(router_port)))
    if gateway is not None:
        sup.add("gateway", gateway, restart(lambda: gateway_child(gateway_port)))
    if redis is not None:
        sup.add("redis", redis.child, redis.start, ready_probe=lambda child: child.alive)
    return sup


def _children_env(cfg: UpConfig) -> dict[str, str]:
    """Every child's environment: the internal secret they share (generated here unless configured)."""
    env = deployment_env(os.environ, cfg.internal_token_file)
    if cfg.internal_token_file is not None:
        env.pop(INTERNAL_TOKEN_ENV, None)   # the file, forwarded as a flag, is the one secret
    return env


def _router_env(cfg: UpConfig, env: dict[str, str]) -> dict[str, str]:
    """The router's and the gateway's: also the public API key (environment, not argv: `ps` shows argv)."""
    if cfg.api_key is None:
        return env
    return {**env, API_KEY_ENV: cfg.api_key}


def _auth_header(cfg: UpConfig) -> str:
    if cfg.api_key is not None:
        return " -H 'Authorization: Bearer <your --api-key>'"
    if os.environ.get(API_KEY_ENV):
        return f" -H \"Authorization: Bearer ${API_KEY_ENV}\""
    return ""


def _display_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else (f"[{host}]" if ":" in host else host)


def _banner(summary: dict, host: str, auth: str = "") -> str:
    """What a person reads once everything is up: where each API and metrics endpoint is."""
    h = _display_host(host)
    addr = summary["router"]
    workers = summary["workers"]
    lines = [f"Tandem is up ({summary['mode']}, {len(workers)} worker{'s' if len(workers) != 1 else ''}):"]
    if "gateway" in summary:
        url = summary["gateway"]
        lines += [f"  OpenAI HTTP API   {url}/v1   (health {url}/health, metrics {url}/metrics)"]
    lines.append(f"  gRPC API          {addr}   (tandem.v1.Generation; the router)")
    if summary.get("router_metrics_port") is not None:
        lines.append(f"  router metrics    http://{h}:{summary['router_metrics_port']}/metrics")
    for w in workers:
        metrics = f"http://{h}:{w['metrics_port']}/metrics" if w.get("metrics_port", -1) >= 0 else "off"
        lines.append(f"  {w['role']:<9s} worker {w['grpc_addr']}   (metrics {metrics})")
    lines.append(f"  registry          {summary['redis_url']}")
    for hw in dict.fromkeys((w["hardware"], w["engine_choices"]) for w in workers if w.get("hardware")):
        lines.append(f"  engine            {hw[0]}: {hw[1]}")
    if summary.get("cpu_placement"):
        lines.append(f"  CPU placement     {summary['cpu_placement']}")
    if "gateway" in summary:
        lines += [
            "Try it over HTTP:",
            f"  curl -s {summary['gateway']}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\",
            "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], "
            "\"max_tokens\": 32, \"temperature\": 0}'",
            "or",
        ]
    else:
        lines.append("Try it")
    lines[-1] += " with the gRPC SDK:"
    lines.append("  .venv/bin/python -c \"from tandem_client import Client; "
                 f"print(Client('{addr}').generate('The capital of France is', max_tokens=16, temperature=0).text)\"")
    lines.append("Ctrl-C stops everything.")
    return "\n".join(lines)
