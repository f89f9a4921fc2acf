"""`tandem bench sweep`: one workload, several request rates, deployments this tool starts itself.

Deployments (a registry; each starts on free local ports and is stopped before the next starts, so
they never share the machine):
    colocated      `tandem up --mode colocated` (one worker does prefill and decode)
    NpMd, e.g.1p1d `tandem up --mode disagg --prefill N --decode M`
    transformers   `transformers serve MODEL_FOLDER --continuous-batching` (the peer), if it runs here
    vllm           vLLM's CPU backend (`python -m vllm.entrypoints.openai.api_server`) from its own venv,
                   `.venv-vllm` (`make vllm-venv`; elsewhere: --vllm-venv or $TANDEM_VLLM_VENV)
A deployment that cannot start is skipped and the reason is kept in the results.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from bench.serve import plots
from bench.serve.backends import BackendConfig, http_url
from bench.serve.datasets import DatasetConfig, load_tokenizer
from bench.serve.metrics import DEFAULT_PERCENTILES, SLO
from bench.serve.serve import ServeConfig, cdf_values, config_dict, machine_info, run_rates, write_json

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]


class DeploymentUnavailable(RuntimeError):
    """The deployment cannot run on this machine (the message says why)."""


VLLM_VENV_ENV = "TANDEM_VLLM_VENV"
_VLLM_VENV_SIZE = "3.5 GB"


def default_vllm_venv() -> str:
    """Where the vLLM peer's venv is: $TANDEM_VLLM_VENV, else `.venv-vllm` in the repository (`make vllm-venv`)."""
    return os.environ.get(VLLM_VENV_ENV) or str(ROOT / ".venv-vllm")


@dataclass(frozen=True)
class SweepConfig:
    model: str = "smollm2-135m"          # Tandem alias or HF folder; the peer gets the resolved folder
    deployments: tuple[str, ...] = ("colocated", "1p1d", "transformers")
    request_rates: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    dataset: DatasetConfig = field(default_factory=lambda: DatasetConfig(num_prompts=40, input_len=256, output_len=64))
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 2
    slo: SLO = field(default_factory=lambda: SLO(ttft=2.0, tpot=0.150))
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    tandem_backend: str = "openai-http"  # through `tandem up`'s gateway, like the peer; or tandem-grpc
    dtype: str = "bfloat16"
    up_args: tuple[str, ...] = ()        # extra `tandem up` flags (engine flags, transfer backend, ...)
    peer_kv_cache_gb: float = 1.0        # the peer's KV cache, as Tandem's default --kv-cache-gb
    peer_args: tuple[str, ...] = ()      # extra `transformers serve` flags
    vllm_venv: str = field(default_factory=default_vllm_venv)  # the vLLM peer's venv (its bin/python runs it)
    vllm_kv_cache_gb: int = 2            # VLLM_CPU_KVCACHE_SPACE (GiB, an integer for vLLM)
    vllm_max_model_len: int = 2048       # --max-model-len (vLLM's default, the model's 8192, wastes its KV space)
    vllm_args: tuple[str, ...] = ()      # extra api_server flags
    start_timeout_s: float = 600.0
    out: str = "bench/results/sweep.json"
    progress: bool = True
    save_requests: bool = True


@dataclass(frozen=True)
class Endpoint:
    backend: str                         # a bench.serve.backends registry name
    base_url: str
    model: str = ""
    force_output_len: str = "ignore-eos"


class Deployment(Protocol):
    name: str

    def start(self) -> Endpoint: ...

    def close(self) -> None: ...

    def describe(self) -> str: ...

    def log_tail(self) -> str: ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Proc:
    """A child process in its own session whose output is kept (last lines) for error messages."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, on_line: Callable[[str], None] | None = None,
                 cwd: str | Path = ROOT):
        self.argv = argv
        self.log: deque[str] = deque(maxlen=200)
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                                     env=env, start_new_session=True)

        def pump() -> None:
            for line in self.proc.stdout:
                self.log.append(line.rstrip())
                if on_line is not None:
                    on_line(line)
        threading.Thread(target=pump, daemon=True).start()

    def tail(self, n: int = 30) -> str:
        return "\n".join(list(self.log)[-n:])

    def stop(self, timeout_s: float = 20.0) -> None:
        # SIGTERM first (graceful), then the whole session: uvicorn waits for open streams forever.
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def stop_group(self, timeout_s: float = 20.0, grace_s: float = 5.0) -> None:
        """SIGTERM to the whole session (a server and the workers it forked), then SIGKILL to whatever is left,
        also after the leader has exited: no child may outlive the deployment."""
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        _killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + grace_s
        while _group_alive(pgid) and time.monotonic() < deadline:  # the forked workers shut down too
            time.sleep(0.1)
        _killpg(pgid, signal.SIGKILL)
        self.proc.wait(10)
        deadline = time.monotonic() + 2.0  # SIGKILL is not instant on a busy machine
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (zombies do not count: PID 1 may be slow to reap orphans)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return _killpg(pgid, 0)
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def _killpg(pgid: int, sig: int) -> bool:
    """Signal a process group; False when no process of it is left."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # only zombies left (macOS reports them so)
        return False


class TandemUp:
    """`tandem up` as a subprocess; ready when it prints its `TANDEM_UP {json}` line."""

    def __init__(self, name: str, mode_args: list[str], cfg: SweepConfig):
        self.name, self.mode_args, self.cfg = name, mode_args, cfg
        self._proc: _Proc | None = None

    def argv(self) -> list[str]:
        # The gateway only when it is what we measure (its default port 8000 may be taken).
        gateway_port = "0" if self.cfg.tandem_backend == "openai-http" else "-1"
        return [sys.executable, "-m", "tandem.cli", "up", "--port", "0", "--quiet", "--ready-json", "--gateway-port", gateway_port,
                *self.mode_args, "--model", self.cfg.model, "--dtype", self.cfg.dtype, *self.cfg.up_args]

    def describe(self) -> str:
        return "tandem " + " ".join(self.argv()[3:])

    def start(self) -> Endpoint:
        info: dict = {}
        ready = threading.Event()

        def on_line(line: str) -> None:
            at = line.find("TANDEM_UP ")
            if at >= 0 and not info:
                info.update(json.loads(line[at + len("TANDEM_UP "):]))
                ready.set()

        env = {k: v for k, v in os.environ.items() if k != "TANDEM_API_KEY"}  # an open gateway
        self._proc = _Proc(self.argv(), env=dict(env, PYTHONUNBUFFERED="1"), on_line=on_line)
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while not ready.wait(0.5):
            if self._proc.proc.poll() is not None or time.monotonic() > deadline:
                raise DeploymentUnavailable(f"`{self.describe()}` did not come up:\n{self._proc.tail()}")
        if self.cfg.tandem_backend == "openai-http":
            if "gateway" not in info:
                raise DeploymentUnavailable("`tandem up` reported no gateway URL; use --tandem-backend tandem-grpc")
            url = http_url(info["gateway"])
            return Endpoint("openai-http", url, first_http_model(url) or self.cfg.model, "ignore-eos")
        return Endpoint("tandem-grpc", info["router"], "", "ignore-eos")

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stop()
            self._proc = None

    def log_tail(self) -> str:
        return self._proc.tail() if self._proc is not None else ""


class TransformersServe:
    """The peer: Hugging Face `transformers serve` on the same model folder, CPU, continuous batching.

    It rejects `ignore_eos` (HTTP 422), so full-length outputs are forced with
    `generation_config={"min_new_tokens": N}`; with continuous batching it takes its generation
    settings from the first request, which the warm-ups (same settings) provide. Its KV cache is
    capped at `peer_kv_cache_gb` like Tandem's: on CPU it otherwise reserves 60% of RAM (14 GiB on
    a 24 GiB machine), which made every token ~4x slower here (concurrency 1: TPOT 337 vs 78 ms).
    """

    name = "transformers"

    def __init__(self, cfg: SweepConfig):
        self.cfg = cfg
        self.port = 0                     # picked at start(): a port picked early may be taken by then
        self._proc: _Proc | None = None

    def executable(self) -> str | None:
        beside = Path(sys.executable).with_name("transformers")
        return str(beside) if beside.exists() else shutil.which("transformers")

    def argv(self, exe: str, folder: str) -> list[str]:
        return [exe, "serve", folder, "--host", "127.0.0.1", "--port", str(self.port or "PORT"), "--device", "cpu",
                "--dtype", self.cfg.dtype, "--continuous-batching",
                "--cb-max-memory-percent", f"{self.memory_fraction():.4f}", *self.cfg.peer_args]

    def memory_fraction(self) -> float:
        """`--cb-max-memory-percent` (a fraction of RAM on CPU) for a cache of `peer_kv_cache_gb`."""
        try:
            total_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        except (ValueError, OSError, AttributeError):
            return 0.05
        return min(0.6, max(0.005, self.cfg.peer_kv_cache_gb / total_gib))

    def describe(self) -> str:
        return " ".join(self.argv("transformers", self.cfg.model))

    def start(self) -> Endpoint:
        exe = self.executable()
        if exe is None:
            raise DeploymentUnavailable("the `transformers` command is not installed (pip install 'transformers[serving]')")
        if self.cfg.dataset.range_ratio > 0:
            log.warning("transformers serve takes min_new_tokens from its first request: with --range-ratio > 0 "
                        "its outputs are not forced to each request's length")
        from engine.model_source import resolve_model

        folder = str(resolve_model(self.cfg.model))
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.port = free_port()
        self._proc = _Proc(self.argv(exe, folder), env=env)
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while not _http_ok(url + "/health"):
            if self._proc.proc.poll() is not None or time.monotonic() > deadline:
                raise DeploymentUnavailable(f"`transformers serve` did not come up:\n{self._proc.tail()}")
            time.sleep(0.5)
        model = first_http_model(url)
        if self._proc.proc.poll() is not None or model != folder:
            # Another server answered on this port (ours lost the race for it, or exited).
            raise DeploymentUnavailable(f"port {self.port} is served by something else (model {model!r}):\n"
                                        f"{self._proc.tail()}")
        return Endpoint("openai-http", url, model, "hf-generation-config")

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stop()
            self._proc = None

    def log_tail(self) -> str:
        return self._proc.tail() if self._proc is not None else ""


class VllmServe:
    """The peer to beat: vLLM's CPU backend, co-located, default scheduling, on the same model folder.

    It lives in a venv of its own (`make vllm-venv`): it pins torch==2.13.0+cpu and many packages that
    must not touch Tandem's. It is started as a module (its `vllm` console script fails: the
    distribution is named vllm-cpu), from a neutral directory (this repository's `engine`, `tandem`,
    ... packages must not shadow anything), with its KV space and max-model-len set by the sweep.
    It compiles its model with inductor at start-up (about 2 minutes on 2 cores): progress lines
    every `progress_every_s`. It honours `ignore_eos`. Stopped as a process group (the API server
    forks an engine-core process).

    Cores: the sweep has no per-deployment core setting, so vLLM keeps its own default
    (VLLM_CPU_OMP_THREADS_BIND=auto: one core is reserved for its API server and scheduler, the OpenMP
    threads get the rest, on 2 cores one thread on CPU 0). VLLM_CPU_* variables in the environment are
    passed on and shown in the recorded command.
    """

    name = "vllm"
    entrypoint: tuple[str, ...] = ("-m", "vllm.entrypoints.openai.api_server")  # tests put a fake server here
    progress_every_s = 15.0
    stop_timeout_s = 20.0                 # for the API server to exit on SIGTERM
    stop_grace_s = 5.0                    # then for the rest of its process group, before SIGKILL

    def __init__(self, cfg: SweepConfig, echo: Callable[[str], None] = print):
        self.cfg, self.echo = cfg, echo
        self.port = 0                     # picked at start(): a port picked early may be taken by then
        self.folder = ""                  # the model folder, resolved at start()
        self._proc: _Proc | None = None

    def python(self) -> Path:
        return Path(self.cfg.vllm_venv) / "bin" / "python"

    def check_venv(self) -> Path:
        """The venv's python, or DeploymentUnavailable saying how to build it."""
        venv, py = Path(self.cfg.vllm_venv), self.python()
        how = (f"build it with `make vllm-venv` (a separate venv, ~{_VLLM_VENV_SIZE}), or point --vllm-venv / "
               f"${VLLM_VENV_ENV} at a venv with vllm-cpu installed")
        if not os.access(py, os.X_OK):
            raise DeploymentUnavailable(f"vLLM's venv {venv} is missing ({py} not found): {how}")
        if not any(venv.glob("lib/python*/site-packages/vllm/__init__.py")):
            raise DeploymentUnavailable(f"vLLM is not installed in {venv}: {how}")
        return py

    def argv(self, python: str | Path, folder: str) -> list[str]:
        return [str(python), *self.entrypoint, "--model", folder, "--host", "127.0.0.1",
                "--port", str(self.port or "PORT"), "--dtype", self.cfg.dtype,
                "--max-model-len", str(self.cfg.vllm_max_model_len), *self.cfg.vllm_args]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        for k in ("PYTHONPATH", "PYTHONHOME", "VLLM_API_KEY"):  # not Tandem's modules; an open server like the others
            env.pop(k, None)
        venv = str(Path(self.cfg.vllm_venv).resolve())
        env.update(VIRTUAL_ENV=venv, PATH=os.pathsep.join([venv + "/bin", env.get("PATH", "")]),
                   VLLM_CPU_KVCACHE_SPACE=str(self.cfg.vllm_kv_cache_gb), VLLM_TARGET_DEVICE="cpu",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   PYTHONUNBUFFERED="1")
        return env

    def describe(self) -> str:
        # With its CPU settings from the environment (e.g. VLLM_CPU_OMP_THREADS_BIND), which change what is measured.
        env = " ".join(f"{k}={v}" for k, v in sorted(self.env().items()) if k.startswith("VLLM_CPU_"))
        return env + " " + " ".join(self.argv(self.python(), self.folder or self.cfg.model))

    def start(self) -> Endpoint:
        py = self.check_venv()
        from engine.model_source import resolve_model

        self.folder = folder = str(resolve_model(self.cfg.model))
        self.port = free_port()
        self._proc = _Proc(self.argv(py, folder), env=self.env(), cwd=Path(self.cfg.vllm_venv))
        url = f"http://127.0.0.1:{self.port}"
        t0 = time.monotonic()
        deadline, next_progress = t0 + self.cfg.start_timeout_s, t0 + self.progress_every_s
        while not _http_ok(url + "/health"):
            now = time.monotonic()
            if self._proc.proc.poll() is not None:
                raise DeploymentUnavailable(f"vLLM's api_server exited ({self._proc.proc.returncode}) before it was "
                                            f"ready:\n{self._proc.tail()}")
            if now > deadline:
                raise DeploymentUnavailable(f"vLLM's api_server was not ready in {self.cfg.start_timeout_s:.0f} s "
                                            f"(--start-timeout):\n{self._proc.tail()}")
            if now >= next_progress:
                last = self._proc.log[-1] if self._proc.log else ""
                self.echo(f"--- {self.name}: starting, {now - t0:.0f} s (it compiles its model once, ~2 min): "
                          f"{last[:160]}")
                next_progress = now + self.progress_every_s
            time.sleep(0.5)
        model = first_http_model(url)
        if self._proc.proc.poll() is not None or model != folder:
            # Another server answered on this port (ours lost the race for it, or exited).
            raise DeploymentUnavailable(f"port {self.port} is served by something else (model {model!r}):\n"
                                        f"{self._proc.tail()}")
        return Endpoint("openai-http", url, model, "ignore-eos")

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stop_group(self.stop_timeout_s, self.stop_grace_s)
            self._proc = None

    def log_tail(self) -> str:
        return self._proc.tail() if self._proc is not None else ""


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def first_http_model(base_url: str, api_key: str | None = None) -> str | None:
    """The first model id an OpenAI-compatible server lists at /v1/models (None if it lists none)."""
    req = urllib.request.Request(http_url(base_url) + "/v1/models",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            data = json.loads(r.read())
        return data["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError):
        return None


_DISAGG = re.compile(r"^(\d+)p(\d+)d$")


def make_deployment(name: str, cfg: SweepConfig, echo: Callable[[str], None] = print) -> Deployment:
    if name == "colocated":
        return TandemUp(name, ["--mode", "colocated"], cfg)
    if name == "transformers":
        return TransformersServe(cfg)
    if name == "vllm":
        return VllmServe(cfg, echo)
    m = _DISAGG.match(name)
    if m:
        return TandemUp(name, ["--mode", "disagg", "--prefill", m.group(1), "--decode", m.group(2)], cfg)
    raise ValueError(f"unknown deployment {name!r}: use colocated, NpMd (e.g. 1p1d), transformers or vllm")


def run_sweep(cfg: SweepConfig, echo=print) -> dict:
    deployments = [make_deployment(n, cfg, echo) for n in cfg.deployments]  # fail fast on a bad name
    with _terminate_as_exit():
        return _run_sweep(cfg, deployments, echo)


@contextlib.contextmanager
def _terminate_as_exit():
    """SIGTERM/SIGHUP raise SystemExit while the sweep runs, so its `finally` stops the deployment it started
    (each runs in its own session: a killed sweep would otherwise leave it serving)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)
    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _run_sweep(cfg: SweepConfig, deployments: list[Deployment], echo) -> dict:
    tokenizer = load_tokenizer(cfg.model)
    results: dict = {
        "tool": "tandem bench sweep", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(),
        "config": config_dict(cfg), "deployments": {}, "skipped": {},
    }
    out = Path(cfg.out)
    for dep in deployments:
        load_before = _load_avg()  # the cores may be shared: say how busy the machine was
        echo(f"--- {dep.name}: starting `{dep.describe()}` (load average {load_before})")
        t0 = time.monotonic()
        try:
            ep = dep.start()
        except DeploymentUnavailable as e:
            echo(f"--- {dep.name}: skipped: {e}")
            results["skipped"][dep.name] = str(e)
            dep.close()
            continue
        except BaseException:  # Ctrl-C or SIGTERM while it starts: stop what was started
            dep.close()
            raise
        try:
            echo(f"--- {dep.name}: up in {time.monotonic() - t0:.0f} s ({ep.backend} {ep.base_url})")
            serve_cfg = ServeConfig(
                backend=ep.backend,
                backend_cfg=BackendConfig(base_url=ep.base_url, model=ep.model, force_output_len=ep.force_output_len),
                dataset=cfg.dataset, request_rates=cfg.request_rates, burstiness=cfg.burstiness,
                max_concurrency=cfg.max_concurrency, num_warmups=cfg.num_warmups, slo=cfg.slo,
                percentiles=cfg.percentiles, progress=cfg.progress, label=dep.name)
            runs = asyncio.run(run_rates(serve_cfg, tokenizer, echo))
            results["deployments"][dep.name] = {
                "command": dep.describe(), "backend": ep.backend, "load_avg_before": load_before,
                "load_avg_after": _load_avg(), "runs": [r.to_dict(cfg.save_requests) for r in runs],
            }
        except Exception as e:  # one broken deployment must not lose the others' results
            log.exception("%s failed; its last output:\n%s", dep.name, dep.log_tail())
            results["skipped"][dep.name] = f"{type(e).__name__}: {e}\n{dep.log_tail()}"
        finally:
            dep.close()
        write_json(out, results)  # after each deployment: a later crash keeps what was measured
    results["table"] = comparison_table(results)
    results["targets"] = target_checks(results, cfg)
    write_json(out, results)
    out.with_suffix(".md").write_text(results["table"] + "\n\n" + "\n".join(results["targets"]) + "\n")
    echo(results["table"])
    echo("\n".join(results["targets"]))
    for name, why in results["skipped"].items():
        echo(f"skipped {name}: {why.splitlines()[0]}")
    echo(f"results: {out}, table: {out.with_suffix('.md')}")
    for p in _plots(results, out):
        echo(f"plot: {p}")
    return results


def _load_avg() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _rows(results: dict):
    for name, dep in results["deployments"].items():
        for run in dep["runs"]:
            yield name, run["request_rate"], run["metrics"]


def comparison_table(results: dict) -> str:
    def f(x, digits=0):
        return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"

    head = ("| deployment | offered req/s | achieved req/s | output tok/s | goodput req/s (% of requests) | "
            "TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms | ITL p99/p50 | failed |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def p(stats: dict, q: str):
        return stats["percentiles"].get(q)

    for name, rate, m in _rows(results):
        total = m["completed"] + m["failed"]
        good_pct = 100.0 * m["good_requests"] / total if total else float("nan")
        lines.append(
            f"| {name} | {rate} | {f(m['request_throughput'], 2)} | {f(m['output_throughput'], 1)} | "
            f"{f(m['goodput'], 2)} ({f(good_pct)}%) | {f(p(m['ttft'], 'p50'))} / {f(p(m['ttft'], 'p99'))} | "
            f"{f(p(m['tpot'], 'p50'))} / {f(p(m['tpot'], 'p99'))} | {f(p(m['itl'], 'p50'))} / {f(p(m['itl'], 'p99'))} | "
            f"{f(m['itl_p99_over_p50'], 2)} | {m['failed']} |")
    return "\n".join(lines)


def target_checks(results: dict, cfg: SweepConfig) -> list[str]:
    """The issue's targets, per offered rate: 1P1D goodput >= co-located and >= 3x transformers;
    1P1D ITL p99/p50 <= 1.5 at the highest rate (the most prefill-heavy load); then the targets against vLLM."""
    deps = results["deployments"]
    by = {n: {r["request_rate"]: r["metrics"] for r in d["runs"]} for n, d in deps.items()}
    disagg = next((n for n in by if _DISAGG.match(n)), None)
    if disagg is None:
        return ["targets: no disaggregated deployment in this sweep"] + vllm_checks(by)
    return _disagg_checks(by, disagg) + vllm_checks(by)


def vllm_checks(by: dict[str, dict[str, dict]]) -> list[str]:
    """Issue [8]'s targets against vLLM's CPU backend, per offered rate: co-located goodput >= 1.2x vLLM's,
    NpMd goodput >= vLLM's (2% slack for a tie, as above)."""
    if "vllm" not in by:
        return []
    out = []
    for rate, v in by["vllm"].items():
        parts = [f"rate {rate}: vllm goodput {v['goodput']:.2f}"]
        for name in by:
            if name == "vllm" or rate not in by[name] or not (name == "colocated" or _DISAGG.match(name)):
                continue
            g, need = by[name][rate]["goodput"], 1.2 if name == "colocated" else 1.0
            verdict = ("MISSED: both 0" if g == 0 == v["goodput"] else
                       "met" if g >= 0.98 * need * v["goodput"] else "MISSED")
            parts.append(f"{name} {g:.2f} ({verdict} >= {need:g}x vllm)")
        out.append("; ".join(parts))
    return out


def _disagg_checks(by: dict[str, dict[str, dict]], disagg: str) -> list[str]:
    out = []
    for rate, m in by[disagg].items():
        parts = [f"rate {rate}: {disagg} goodput {m['goodput']:.2f}"]
        if "colocated" in by and rate in by["colocated"]:
            # 2% slack: the same number of good requests over windows a few ms apart is a tie.
            c = by["colocated"][rate]["goodput"]
            parts.append(f"colocated {c:.2f} ({'met' if m['goodput'] >= 0.98 * c else 'MISSED'} >=)")
        if "transformers" in by and rate in by["transformers"]:
            t = by["transformers"][rate]["goodput"]
            if t > 0:
                ratio = m["goodput"] / t
                parts.append(f"transformers {t:.2f} ({ratio:.1f}x, {'met' if ratio >= 3 else 'MISSED'} >= 3x)")
            else:
                parts.append(f"transformers 0.00 ({'met' if m['goodput'] > 0 else 'MISSED: both 0'} >= 3x)")
        out.append("; ".join(parts))
    last = list(by[disagg])[-1]
    ratio = by[disagg][last]["itl_p99_over_p50"]
    verdict = "met" if ratio is not None and ratio <= 1.5 else "MISSED"
    out.append(f"{disagg} ITL p99/p50 at rate {last}: {ratio:.2f} ({verdict} <= 1.5)"
               if ratio is not None else f"{disagg} ITL p99/p50 at rate {last}: n/a")
    return out


def _plots(results: dict, out: Path) -> list[Path]:
    series = {name: [(_rate(r["request_rate"]), r["metrics"]) for r in d["runs"]]
              for name, d in results["deployments"].items()}
    made = []
    if series:
        p = plots.plot_vs_rate(series, out.with_suffix(".rates.png"), title="Tandem vs request rate")
        made.append(p)
        cdfs = {}
        for name, d in results["deployments"].items():
            if d["runs"] and "requests" in d["runs"][-1]:
                cdfs[f"{name} @ {d['runs'][-1]['request_rate']}"] = cdf_values(d["runs"][-1]["requests"])
        if cdfs:
            made.append(plots.plot_cdfs(cdfs, out.with_suffix(".cdf.png"), title="latency CDFs at the highest rate"))
    return [p for p in made if p is not None]


def _rate(label: str) -> float:
    return math.inf if label == "inf" else float(label)
