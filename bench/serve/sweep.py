"""`tandem bench sweep`: one workload, several request rates, deployments this tool starts itself.

Deployments (a registry; each starts on free local ports and is stopped before the next starts, so
they never share the machine):
    colocated      `tandem up --mode colocated` (one worker does prefill and decode)
    colocated-dpN  `tandem up --mode colocated --colocated N` (N co-located replicas, cores split between them)
    NpMd, e.g.1p1d `tandem up --mode disagg --prefill N --decode M`
    transformers   `transformers serve MODEL_FOLDER --continuous-batching` (the peer), if it runs here
    vllm           vLLM's CPU backend (`python -m vllm.entrypoints.openai.api_server`) from its own venv,
                   `.venv-vllm` (`make vllm-venv`; elsewhere: --vllm-venv or $TANDEM_VLLM_VENV)
A deployment that cannot start is skipped and the reason is kept in the results.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tandem.bench.results import write_result
from tandem.bench.serve import capacity as cap
from tandem.bench.serve.backends import BackendConfig, http_url
from tandem.bench.serve.datasets import DatasetConfig, load_tokenizer
from tandem.bench.serve.deployment import (  # noqa: F401 (sweep.* API)
    Deployment,
    DeploymentUnavailable,
    Endpoint,
    measure_deployment,
)
from tandem.bench.serve.metrics import DEFAULT_PERCENTILES, SLO
from tandem.bench.serve.procs import ROOT, UpFailed, _Proc, start_tandem_up
from tandem.bench.serve.serve import ServeConfig, config_dict, machine_info, run_rates
from tandem.bench.serve.sweep_report import (  # noqa: F401 (sweep.* API)
    _COLOCATED,
    _DISAGG,
    _plots,
    comparison_table,
    summary_table,
    target_checks,
)
from tandem.kernels.cpu import isa

log = logging.getLogger(__name__)


VLLM_VENV_ENV = "TANDEM_VLLM_VENV"
ISA_CAP_DIR = Path(__file__).with_name("isa_cap")   # its sitecustomize caps vLLM's own ISA checks


def capped_isa(env: dict[str, str]) -> str | None:
    """The ISA level `env` caps this CPU to (ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA), or None
    when nothing is capped below what the CPU has."""
    level = isa.effective_level(env)
    return level if level != isa.host_level() else None
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
    dtype: str = "auto"                  # auto: what Tandem picks for this model here (resolved once, see auto_dtype)
    up_args: tuple[str, ...] = ()        # extra `tandem up` flags (engine flags, transfer backend, ...)
    peer_kv_cache_gb: float = 1.0        # the peer's KV cache, as Tandem's default --kv-cache-gb
    peer_args: tuple[str, ...] = ()      # extra `transformers serve` flags
    vllm_venv: str = field(default_factory=default_vllm_venv)  # the vLLM peer's venv (its bin/python runs it)
    vllm_kv_cache_gb: int = 2            # VLLM_CPU_KVCACHE_SPACE (GiB, an integer for vLLM); 0: unset, vllm_args size it
    vllm_max_model_len: int = 2048       # --max-model-len (vLLM's default, the model's 8192, wastes its KV space)
    vllm_args: tuple[str, ...] = ()      # extra api_server flags
    start_timeout_s: float = 600.0
    out: str = "bench/results/sweep.json"
    capacity: cap.CapacityConfig | None = None   # --find-capacity: search each deployment's capacity at SLO
    progress: bool = True
    save_requests: bool = True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TandemUp:
    """`tandem up` as a subprocess; ready when it prints its `TANDEM_UP {json}` line."""

    def __init__(self, name: str, mode_args: list[str], cfg: SweepConfig,
                 on_line: Callable[[str], None] | None = None):
        self.name, self.mode_args, self.cfg = name, mode_args, cfg
        self.on_line = on_line            # sees every output line (e.g. `TANDEM_RESTARTED {json}`)
        self.info: dict = {}              # its `TANDEM_UP` summary (workers, pids), once started
        self._proc: _Proc | None = None

    def argv(self) -> list[str]:
        return [sys.executable, "-P", "-m", "tandem.cli", "up", *self.up_args()]

    def up_args(self) -> list[str]:
        # The gateway only when it is what we measure (its default port 8000 may be taken).
        gateway_port = "0" if self.cfg.tandem_backend == "openai-http" else "-1"
        return ["--port", "0", "--quiet", "--ready-json", "--gateway-port", gateway_port,
                *self.mode_args, "--model", self.cfg.model, "--dtype", self.cfg.dtype, *self.cfg.up_args]

    def describe(self) -> str:
        return "tandem " + " ".join(self.argv()[3:])

    def start(self) -> Endpoint:
        env = {k: v for k, v in os.environ.items() if k != "TANDEM_API_KEY"}  # an open gateway
        try:
            self._proc, info = start_tandem_up(self.up_args(), self.cfg.start_timeout_s, env=env,
                                               on_line=self.on_line)
        except UpFailed as e:
            raise DeploymentUnavailable(str(e)) from None
        self.info = info
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
        from tandem.engine.models.source import resolve_model

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
        self.on_line: Callable[[str], None] | None = None   # sees every output line
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
        if not self.cfg.vllm_kv_cache_gb:  # unset: it would override --kv-cache-memory-bytes ("" fails int())
            del env["VLLM_CPU_KVCACHE_SPACE"]
        level = capped_isa(env)
        if level is not None:   # an emulated older CPU: vLLM's own kernel choice must see it too
            env.update(PYTHONPATH=str(ISA_CAP_DIR), TANDEM_PEER_ISA=level)
        return env

    def describe(self) -> str:
        # With its CPU settings from the environment (e.g. VLLM_CPU_OMP_THREADS_BIND), which change what is measured.
        env = " ".join(f"{k}={v}" for k, v in sorted(self.env().items()) if k.startswith("VLLM_CPU_"))
        return env + " " + " ".join(self.argv(self.python(), self.folder or self.cfg.model))

    def start(self) -> Endpoint:
        py = self.check_venv()
        from tandem.engine.models.source import resolve_model

        self.folder = folder = str(resolve_model(self.cfg.model))
        self.port = free_port()
        self._proc = _Proc(self.argv(py, folder), env=self.env(), cwd=Path(self.cfg.vllm_venv), on_line=self.on_line)
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




def auto_dtype(model: str) -> str:
    """The dtype `tandem up --dtype auto` serves `model` in on this machine (engine/runner/model_runner.py's rule,
    which asks what this device computes fast). The sweep gives it to every deployment, the peers too:
    their own `auto` would read the checkpoint's dtype (fp32 for the imported SmolLM2) and compare
    different arithmetic."""
    import torch

    from tandem.engine.models.config import ModelConfig
    from tandem.engine.models.source import resolve_model
    from tandem.engine.runner.model_runner import resolve_dtype

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    chosen = resolve_dtype("auto", ModelConfig.from_pretrained(resolve_model(model)), device)
    return str(chosen).removeprefix("torch.")


def make_deployment(name: str, cfg: SweepConfig, echo: Callable[[str], None] = print) -> Deployment:
    m = _COLOCATED.match(name)
    if m:
        return TandemUp(name, ["--mode", "colocated", "--colocated", m.group(1) or "1"], cfg)
    if name == "transformers":
        return TransformersServe(cfg)
    if name == "vllm":
        return VllmServe(cfg, echo)
    m = _DISAGG.match(name)
    if m:
        return TandemUp(name, ["--mode", "disagg", "--prefill", m.group(1), "--decode", m.group(2)], cfg)
    raise ValueError(f"unknown deployment {name!r}: use colocated, colocated-dpN (N co-located replicas), "
                     "NpMd (e.g. 1p1d), transformers or vllm")


def run_sweep(cfg: SweepConfig, echo=print) -> dict:
    for n in cfg.deployments:
        make_deployment(n, cfg, echo)                  # fail fast on a bad name, before resolving the dtype
    requested = cfg.dtype
    if cfg.dtype == "auto":
        cfg = dataclasses.replace(cfg, dtype=auto_dtype(cfg.model))
        echo(f"--- dtype auto: {cfg.dtype} (what Tandem picks for this model here), for every deployment")
    deployments = [make_deployment(n, cfg, echo) for n in cfg.deployments]
    with _terminate_as_exit():
        return _run_sweep(cfg, deployments, echo, requested)


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


def _run_sweep(cfg: SweepConfig, deployments: list[Deployment], echo, requested_dtype: str) -> dict:
    tokenizer = load_tokenizer(cfg.model)
    results: dict = {
        "tool": "tandem bench sweep", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(),
        "config": {**config_dict(cfg), "dtype": requested_dtype}, "dtype": cfg.dtype,   # as asked, as served
        "deployments": {}, "skipped": {},
    }
    out = Path(cfg.out)
    for dep in deployments:
        def serve_cfg(ep: Endpoint, dep=dep) -> ServeConfig:
            return ServeConfig(
                backend=ep.backend,
                backend_cfg=BackendConfig(base_url=ep.base_url, model=ep.model, force_output_len=ep.force_output_len),
                dataset=cfg.dataset, request_rates=cfg.request_rates, burstiness=cfg.burstiness,
                max_concurrency=cfg.max_concurrency, num_warmups=cfg.num_warmups, slo=cfg.slo,
                percentiles=cfg.percentiles, progress=cfg.progress, label=dep.name)

        def run(ep: Endpoint, dep=dep) -> dict:
            if cfg.capacity is not None:
                return _capacity_runs(cfg, serve_cfg(ep), tokenizer, dep.name, echo)
            runs = asyncio.run(run_rates(serve_cfg(ep), tokenizer, echo))
            return {"runs": [r.to_dict(cfg.save_requests) for r in runs]}

        entry, why = measure_deployment(dep, run, echo)
        if entry is None:
            results["skipped"][dep.name] = why
        else:
            results["deployments"][dep.name] = entry
        # after each deployment: a later crash keeps what was measured
        write_result(out, results, tool="tandem.bench.serve")
    if cfg.capacity is not None:
        results["capacity"] = cap.report(cfg.model, cfg.dtype, cfg.dataset, results["deployments"], echo)
    results["table"] = comparison_table(results)          # Markdown, for the .md file and docs
    results["summary"] = summary_table(results, cfg.slo)  # aligned text, for the terminal
    results["targets"] = target_checks(results, cfg)
    write_result(out, results, tool="tandem.bench.serve")
    out.with_suffix(".md").write_text(f"{results['table']}\n\n{cfg.slo.describe()}\n\n"
                                      + "\n".join(results["targets"]) + "\n")
    echo(results["summary"])
    echo("targets:\n" + "\n".join("  " + t for t in results["targets"]))
    for name, why in results["skipped"].items():
        echo(f"skipped {name}: {why.splitlines()[0]}")
    echo(f"results: {out}, table: {out.with_suffix('.md')}")
    for p in _plots(results, out):
        echo(f"plot: {p}")
    return results


def _capacity_runs(cfg: SweepConfig, base: ServeConfig, tokenizer, name: str, echo) -> dict:
    """One deployment's capacity search: one run per rate tried, each with prompts and arrivals of its own."""
    tried = 0

    def run_one(rate: float, seed: int) -> dict:
        nonlocal tried
        tried += 1
        dataset = dataclasses.replace(cfg.dataset, seed=cfg.dataset.seed + 1000 * seed + tried,
                                      num_prompts=cfg.capacity.num_prompts(rate, cfg.dataset.num_prompts))
        one = dataclasses.replace(base, request_rates=(rate,), dataset=dataset)
        (result,) = asyncio.run(run_rates(one, tokenizer, echo))
        return result.to_dict(cfg.save_requests)

    summary, runs = cap.find_capacity(run_one, cfg.capacity, echo, name)
    return {"runs": runs, "capacity": summary}
