"""Issue [16]'s benchmark: the KV tiers on a multi-turn workload, with and without, against vLLM.

    python -m tandem.bench.serve.kvtiers [--configs colo,colo-tiers,1p1d,1p1d-tiers,vllm] [--out FILE.json]
    python -m tandem.bench.serve.kvtiers --warm-restart [--out FILE.json]      (bench/serve/kvtiers_restart.py)

One run starts each configuration in turn (bench/serve/sweep.py's deployments, never two at once) and
sends it the same seeded multi-turn workload (bench/serve/multiturn.py):

    colo         `tandem up --mode colocated`, no tiers
    colo-tiers   the same with L2 (`--kv-host-cache-gb`) and L3 (`--kv-disk-cache-dir` a fresh temporary
                 directory, `--kv-disk-cache-gb`)
    1p1d         `tandem up --mode disagg --prefill 1 --decode 1`, no tiers
    1p1d-tiers   the same with the tier flags (workers that do not wire tiers yet warn and turn them off)
    1p1d-tiers-no-d2p  the same with `--kv-reuse-policy never`: P never fetches the earlier answers D
                 holds (issue [22]'s before; 1p1d-tiers is after: `auto`, the default)
    vllm         vLLM's CPU backend, prefix caching on, the same dtype and the same KV pool in tokens

With `--hosts` (root) the 1P1D configurations run across network-namespace hosts instead, P's link
shaped to `--link-mbit` (bench/serve/kvtiers_hosts.py).

The L1 budget is one number of tokens for every server (`--max-total-tokens` on each Tandem worker;
vLLM's block count, see kvtiers_report.vllm_kv_args), by default the largest multiple of 128 tokens
(Tandem's page 16, vLLM CPU's block 128) that makes the workload's working set >= 4x L1. The pool each
server actually built is read back from it (Tandem's `tandem_kv_pages{state="total"}` metric, vLLM's
`KV cache size: N tokens` log line) and recorded next to the budget.

Writes one JSON (per configuration: its command, its KV capacity as built, the full run with every
request, and a summary; the ratios; the budget) and a PNG beside it; prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tandem.bench.flags import add_load_flags, add_out_flag, add_progress_flags, add_stack_flags
from tandem.bench.results import write_result
from tandem.bench.serve import kvtiers_report as report
from tandem.bench.serve import multiturn
from tandem.bench.serve.backends import BackendConfig
from tandem.bench.serve.datasets import DatasetConfig, load_tokenizer
from tandem.bench.serve.metrics import SLO
from tandem.bench.serve.serve import ServeConfig, config_dict, machine_info, run_rates
from tandem.bench.serve.sweep import (
    Deployment,
    Endpoint,
    SweepConfig,
    TandemUp,
    VllmServe,
    _terminate_as_exit,
    auto_dtype,
    default_vllm_venv,
    measure_deployment,
)

log = logging.getLogger(__name__)

TANDEM_PAGE_SIZE = 16                    # Tandem's default --page-size
VLLM_CPU_BLOCK_SIZE = 128                # vLLM CPU's default block size (a multiple of 32 keeps its kernels fast)
GRANULE = 128                            # a multiple of both: the L1 budget is exact on both servers

# name -> (`tandem up` mode flags, tiers on)
TANDEM_CONFIGS: dict[str, tuple[tuple[str, ...], bool]] = {
    "colo": (("--mode", "colocated", "--colocated", "1"), False),
    "colo-tiers": (("--mode", "colocated", "--colocated", "1"), True),
    "1p1d": (("--mode", "disagg", "--prefill", "1", "--decode", "1"), False),
    "1p1d-tiers": (("--mode", "disagg", "--prefill", "1", "--decode", "1"), True),
    # Issue [22]'s KV both ways, off: P computes again the earlier answers only D holds.
    "1p1d-tiers-no-d2p": (("--mode", "disagg", "--prefill", "1", "--decode", "1", "--kv-reuse-policy", "never"), True),
}
ALL_CONFIGS = (*TANDEM_CONFIGS, "vllm")
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
SLO_TEXT = "ttft=2s,tpot=500ms"           # goodput's default SLO (--slo)


@dataclass(frozen=True)
class KVTiersConfig:
    model: str = "smollm2-135m"
    configs: tuple[str, ...] = ("colo", "colo-tiers", "1p1d", "1p1d-tiers", "vllm")   # [16]'s comparison
    conversations: int = 32
    turns: int = 6
    user_len: int = 200                  # user tokens each turn adds (range_ratio applies)
    output_len: int = 48                 # each answer's tokens (range_ratio applies: 32-64 by default)
    range_ratio: float = 0.33
    think_time_s: float = 20.0           # mean pause between an answer and the next turn (exponential)
    rate: float = 1.0                    # conversation starts per second (Poisson): all conversations in flight at once
    seed: int = 0
    num_warmups: int = 2                 # first turns of conversations of their own, before the measured run
    l1_tokens: int | None = None         # None: the largest that makes the working set >= working_set_ratio x L1
    working_set_ratio: float = 4.0
    host_cache_gb: float = 1.0           # L2 (--kv-host-cache-gb) of the tiered configurations
    disk_cache_gb: float = 2.0           # L3 budget (--kv-disk-cache-gb)
    disk_root: str | None = None         # where the fresh L3 directories are made (None: the system's temp dir)
    slo: SLO = field(default_factory=lambda: SLO.parse(SLO_TEXT))
    dtype: str = "auto"                  # auto: what Tandem picks here, given to vLLM too
    up_args: tuple[str, ...] = ()        # extra `tandem up` flags for every Tandem configuration
    vllm_venv: str = field(default_factory=default_vllm_venv)
    vllm_max_model_len: int = 2048       # capped at the L1 budget (vLLM refuses a longer one)
    vllm_args: tuple[str, ...] = ()
    start_timeout_s: float = 600.0
    hosts: bool = False                  # 1P1D configurations with P and D on namespace hosts (kvtiers_hosts.py)
    link_mbit: float | None = None       # with hosts: P's link shaped to this (tc tbf); None: unshaped
    out: str = "bench/results/kvtiers.json"
    progress: bool = True
    # --warm-restart (kvtiers_restart.py)
    restart_after_turn: int = 3          # kill once half the conversations have finished this turn
    restart_timeout_s: float = 300.0     # for the killed worker to be back

    def dataset(self) -> DatasetConfig:
        return DatasetConfig(name=multiturn.NAME, output_len=self.output_len, range_ratio=self.range_ratio,
                             seed=self.seed, multi_turn_conversations=self.conversations,
                             multi_turn_turns=self.turns, multi_turn_user_len=self.user_len,
                             multi_turn_think_time=self.think_time_s)

    def sweep_config(self, dtype: str) -> SweepConfig:
        """What the sweep's deployments read (model, dtype, start timeout, vLLM's venv); vLLM's KV from flags."""
        return SweepConfig(model=self.model, dtype=dtype, up_args=self.up_args, vllm_venv=self.vllm_venv,
                           vllm_kv_cache_gb=0, start_timeout_s=self.start_timeout_s, progress=self.progress)


def parse_configs(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in ALL_CONFIGS]
    if bad or not names:
        raise ValueError(f"unknown configuration(s) {', '.join(bad) or '(none)'}: choose from {', '.join(ALL_CONFIGS)}")
    return names


def tandem_args(name: str, cfg: KVTiersConfig, l1_tokens: int, disk_dir: str) -> list[str]:
    """`tandem up` flags of Tandem configuration `name` (mode, L1 in tokens, tiers when it has them)."""
    mode, tiers = TANDEM_CONFIGS[name]
    args = [*mode, "--max-total-tokens", str(l1_tokens)]
    if tiers:
        args += ["--kv-host-cache-gb", f"{cfg.host_cache_gb:g}", "--kv-disk-cache-dir", disk_dir,
                 "--kv-disk-cache-gb", f"{cfg.disk_cache_gb:g}"]
    return args


def vllm_config(cfg: KVTiersConfig, sweep_cfg: SweepConfig, l1_tokens: int, bytes_per_token: int) -> SweepConfig:
    return dataclasses.replace(
        sweep_cfg, vllm_max_model_len=min(cfg.vllm_max_model_len, l1_tokens),
        vllm_args=(*report.vllm_kv_args(l1_tokens, VLLM_CPU_BLOCK_SIZE, bytes_per_token), *cfg.vllm_args))


class TandemConfigUp(TandemUp):
    """A Tandem configuration (`config`, a TANDEM_CONFIGS name; the deployment may be named otherwise):
    `tandem up` with the L1 budget in tokens and, with tiers, an L3 directory made fresh at each start
    and removed at close."""

    def __init__(self, name: str, cfg: KVTiersConfig, sweep_cfg: SweepConfig, l1_tokens: int,
                 config: str | None = None, on_line=None):
        self.config = config or name
        super().__init__(name, tandem_args(self.config, cfg, l1_tokens, "<fresh temporary dir>"), sweep_cfg, on_line)
        self.kv, self.l1_tokens = cfg, l1_tokens
        self.disk_dir: str | None = None

    def start(self) -> Endpoint:
        if TANDEM_CONFIGS[self.config][1]:
            self.disk_dir = tempfile.mkdtemp(prefix=f"tandem-kvtiers-{self.name}-", dir=self.kv.disk_root)
            self.mode_args = tandem_args(self.config, self.kv, self.l1_tokens, self.disk_dir)
        return super().start()

    def close(self) -> None:
        super().close()
        if self.disk_dir is not None:
            shutil.rmtree(self.disk_dir, ignore_errors=True)
            self.disk_dir = None

    def kv_capacity(self) -> dict:
        """Each worker's KV pool as built, in tokens (its pages x page size), read from its metrics."""
        return {_worker_label(w): pool_tokens(_metrics(w.get("metrics_port"))) for w in self.info.get("workers", [])}

    def tier_hits(self) -> dict:
        """Each worker's blocks loaded per tier (`tandem_kv_tier_hits_total`): whether its tiers served anything."""
        return {_worker_label(w): tier_hits(_metrics(w.get("metrics_port"))) for w in self.info.get("workers", [])}

    def kv_reuse(self) -> dict:
        """KV both ways: the router's decisions (`tandem_router_kv_reuse_total`) and the prompt tokens the
        prefill workers fetched from decode workers (`tandem_kv_fetched_tokens_total`)."""
        prefill = [_metrics(w.get("metrics_port")) for w in self.info.get("workers", []) if w.get("role") == "prefill"]
        return reuse_summary(prefill, _metrics(self.info.get("router_metrics_port")))


def reuse_summary(prefill_metrics: list[str], router_metrics: str) -> dict:
    """KV both ways from the metrics texts: the router's fetch/compute decisions and the tokens P fetched."""
    fetched = sum(_sample(text, "tandem_kv_fetched_tokens_total") for text in prefill_metrics)
    return {"router_decisions": {d: int(float(n)) for d, n in _REUSE.findall(router_metrics)},
            "fetched_tokens": int(fetched)}


_PAGES_TOTAL = re.compile(r'^tandem_kv_pages\{state="total"\} ([0-9.e+]+)$', re.M)
_TIER_HITS = re.compile(r'^tandem_kv_tier_hits_total\{tier="([^"]+)"\} ([0-9.e+]+)$', re.M)
_REUSE = re.compile(r'^tandem_router_kv_reuse_total\{decision="([^"]+)"\} ([0-9.e+]+)$', re.M)
_VLLM_KV_TOKENS = re.compile(r"KV cache size: ([0-9,]+) tokens")


def _worker_label(w: dict) -> str:
    return f"{w.get('role')} {w.get('worker_id')}"


def _metrics(port: int | None) -> str:
    return metrics_text(f"http://127.0.0.1:{port}/metrics") if port else ""


def metrics_text(url: str) -> str:
    """A Prometheus endpoint's text ("" when it does not answer)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode()
    except OSError:
        return ""


def pool_tokens(metrics_text: str) -> int | None:
    m = _PAGES_TOTAL.search(metrics_text)
    return int(float(m.group(1))) * TANDEM_PAGE_SIZE if m else None


def _sample(metrics_text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", metrics_text, re.M)
    return float(m.group(1)) if m else 0.0


def tier_hits(metrics_text: str) -> dict[str, int]:
    return {tier: int(float(n)) for tier, n in _TIER_HITS.findall(metrics_text)}


def vllm_pool_tokens(log_lines) -> int | None:
    """The KV capacity vLLM logs at start (`CPU KV cache size: 2,176 tokens`). It counts every block,
    the null block its pool keeps back too: usable = this - one block."""
    for line in log_lines:
        m = _VLLM_KV_TOKENS.search(line)
        if m:
            return int(m.group(1).replace(",", ""))
    return None


class VllmWithCapacity(VllmServe):
    """vLLM that keeps the `KV cache size` line of its output (its kept last lines may move past it)."""

    def start(self) -> Endpoint:
        self.capacity_tokens: int | None = None

        def watch(line: str) -> None:
            if self.capacity_tokens is None:
                self.capacity_tokens = vllm_pool_tokens([line])
        self.on_line = watch
        return super().start()

    def kv_capacity(self) -> dict:
        logged = self.capacity_tokens
        return {"vllm (logged)": logged, "vllm (usable: less the null block)":
                None if logged is None else logged - VLLM_CPU_BLOCK_SIZE}

    def tier_hits(self) -> dict:
        return {}

    def kv_reuse(self) -> dict:
        return {}


def kv_bytes_per_token(model: str, dtype: str) -> int:
    from tandem.engine.models.config import ModelConfig  # torch-free
    from tandem.engine.models.source import resolve_model

    return ModelConfig.from_pretrained(resolve_model(model)).kv_bytes_per_token(_DTYPE_BYTES[dtype])


@dataclass(frozen=True)
class Plan:
    """What every configuration of one run shares: the dtype, the script, the budget."""

    dtype: str
    convs: list
    l1_tokens: int
    budget: dict


def plan(cfg: KVTiersConfig, tokenizer, dtype: str) -> Plan:
    convs = multiturn.build_conversations(cfg.dataset(), tokenizer)
    ws, largest = report.script_working_set(convs), report.largest_request(convs)
    l1 = cfg.l1_tokens if cfg.l1_tokens is not None else report.choose_l1_tokens(ws, cfg.working_set_ratio, GRANULE)
    report.check_l1(l1, largest, GRANULE)
    budget = {"l1_tokens": l1, "working_set_tokens": ws, "largest_request_tokens": largest,
              "working_set_over_l1": ws / l1, "working_set_ratio_target": cfg.working_set_ratio,
              "working_set_ge_target": ws >= cfg.working_set_ratio * l1,
              "how": "L1 = --max-total-tokens on every Tandem worker (1P1D: P and D each); vLLM: "
                     f"--num-gpu-blocks-override (L1 / {VLLM_CPU_BLOCK_SIZE} + its null block); working set = "
                     "every conversation's user turns + answers, summed (from the seeded script)"}
    return Plan(dtype, convs, l1, budget)


def resolve_dtype(cfg: KVTiersConfig, echo=print) -> str:
    if cfg.dtype != "auto":
        return cfg.dtype
    dtype = auto_dtype(cfg.model)
    echo(f"--- dtype auto: {dtype} (what Tandem picks for this model here), vLLM gets it too")
    return dtype


def make_deployment(name: str, cfg: KVTiersConfig, p: Plan, echo=print) -> Deployment:
    sweep_cfg = cfg.sweep_config(p.dtype)
    if name == "vllm":
        return VllmWithCapacity(vllm_config(cfg, sweep_cfg, p.l1_tokens, kv_bytes_per_token(cfg.model, p.dtype)), echo)
    if cfg.hosts:
        from tandem.bench.serve.kvtiers_hosts import ClusterConfigUp

        tiers = TANDEM_CONFIGS[name][1]
        up = [*tandem_args(name, cfg, p.l1_tokens, "<per host>"), "--dtype", p.dtype, *cfg.up_args]
        return ClusterConfigUp(name, up, tiers, cfg.model, cfg.link_mbit, cfg.start_timeout_s,
                               sweep_cfg.tandem_backend, cfg.disk_root)
    return TandemConfigUp(name, cfg, sweep_cfg, p.l1_tokens)


def run_kvtiers(cfg: KVTiersConfig, echo=print) -> dict:
    for n in cfg.configs:
        if n not in ALL_CONFIGS:
            raise ValueError(f"unknown configuration {n!r}: choose from {', '.join(ALL_CONFIGS)}")
    tokenizer = load_tokenizer(cfg.model)
    p = plan(cfg, tokenizer, resolve_dtype(cfg, echo))
    echo(f"workload: {multiturn.describe(p.convs)}; KV budget {p.budget}")
    out = Path(cfg.out)
    results: dict = {"tool": "python -m tandem.bench.serve.kvtiers", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     "machine": machine_info(), "config": config_dict(cfg), "dtype": p.dtype,
                     "slo": str(cfg.slo), "slo_text": cfg.slo.describe(), "kv_budget": p.budget,
                     "configs": {}, "summaries": {}, "skipped": {}}
    with _terminate_as_exit():
        for name in cfg.configs:
            dep = make_deployment(name, cfg, p, echo)

            def run(ep: Endpoint, dep=dep) -> dict:
                serve_cfg = ServeConfig(
                    backend=ep.backend, backend_cfg=BackendConfig(base_url=ep.base_url, model=ep.model,
                                                                  force_output_len=ep.force_output_len),
                    dataset=cfg.dataset(), request_rates=(cfg.rate,), num_warmups=cfg.num_warmups, slo=cfg.slo,
                    progress=cfg.progress, label=dep.name)
                rate_run = asyncio.run(run_rates(serve_cfg, tokenizer, echo))[0].to_dict(save_requests=True)
                return {"kv_capacity_tokens": dep.kv_capacity(), "kv_tier_hits": dep.tier_hits(),
                        "kv_reuse": dep.kv_reuse(), "run": rate_run}

            entry, why = measure_deployment(dep, run, echo)
            if entry is None:
                results["skipped"][name] = why
            else:
                results["configs"][name] = entry
                results["summaries"][name] = report.config_summary(entry["run"])
                echo(f"--- {name}: KV capacity as built (tokens): {entry['kv_capacity_tokens']}; "
                     f"blocks loaded from the tiers: {entry['kv_tier_hits'] or '-'}; KV both ways: "
                     f"{entry['kv_reuse'] or '-'}")
            # after each configuration: a later crash keeps what was measured
            write_result(out, results, tool="tandem.bench.serve.kvtiers")
    results["ratios"] = report.ratios(results["summaries"])
    results["table"] = report.summary_text(results)
    write_result(out, results, tool="tandem.bench.serve.kvtiers")
    out.with_suffix(".md").write_text(results["table"] + "\n")
    echo(results["table"])
    for name, why in results["skipped"].items():
        echo(f"skipped {name}: {why.splitlines()[0] if why else ''}")
    echo(f"results: {out}, table: {out.with_suffix('.md')}")
    png = report.plot(results, out.with_suffix(".png"))
    if png is not None:
        echo(f"plot: {png}")
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = KVTiersConfig()
    add_stack_flags(p, model=d.model)
    p.add_argument("--configs", type=parse_configs, default=d.configs,
                   help=f"comma-separated, run in this order (default: {','.join(d.configs)})")
    p.add_argument("--conversations", type=int, default=d.conversations)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--user-len", type=int, default=d.user_len, help="user tokens each turn adds")
    add_load_flags(p, output_len=d.output_len, range_ratio=d.range_ratio, helps={
        "output_len": "tokens of each answer", "range_ratio": "user and answer lengths uniform in [L(1-r), L(1+r)]"})
    p.add_argument("--think-time", type=float, default=d.think_time_s, help="mean s between an answer and the next turn")
    p.add_argument("--rate", type=float, default=d.rate, help="conversation starts per second (Poisson)")
    add_load_flags(p, seed=d.seed, num_warmups=d.num_warmups)
    p.add_argument("--l1-tokens", type=int, default=None,
                   help=f"KV pool of every server in tokens, a multiple of {GRANULE} "
                        "(default: the largest that makes the working set >= --working-set-ratio x L1)")
    p.add_argument("--working-set-ratio", type=float, default=d.working_set_ratio)
    p.add_argument("--kv-host-cache-gb", type=float, default=d.host_cache_gb, help="L2 of the tiered configurations")
    p.add_argument("--kv-disk-cache-gb", type=float, default=d.disk_cache_gb, help="L3 of the tiered configurations")
    p.add_argument("--disk-root", default=None, help="where fresh L3 directories are made (default: the temp dir)")
    add_load_flags(p, slo=SLO_TEXT, helps={"slo": "goodput's SLO"})
    p.add_argument("--dtype", default=d.dtype, help="auto: what Tandem picks here; vLLM gets the same")
    add_stack_flags(p, up_args="", helps={"up_args": "extra `tandem up` flags for every Tandem configuration"})
    p.add_argument("--vllm-venv", default=d.vllm_venv)
    p.add_argument("--vllm-max-model-len", type=int, default=d.vllm_max_model_len)
    p.add_argument("--vllm-args", default="", help="extra vLLM api_server flags")
    add_stack_flags(p, start_timeout=d.start_timeout_s)
    add_out_flag(p, help=f"results JSON (default {d.out}, --warm-restart: bench/results/kvtiers_restart.json); "
                         ".md and .png beside it")
    add_progress_flags(p)
    p.add_argument("--hosts", action="store_true",
                   help="1P1D configurations only: P, D and the router on network-namespace hosts of their own (root)")
    p.add_argument("--link-mbit", type=float, default=None, help="--hosts: shape P's link to this many Mbit/s")
    p.add_argument("--warm-restart", action="store_true",
                   help="instead: co-located with L3, kill -9 its worker mid-run, and without L3 the same")
    p.add_argument("--restart-after-turn", type=int, default=d.restart_after_turn,
                   help="--warm-restart: kill once half the conversations have finished this turn")
    p.add_argument("--restart-timeout", type=float, default=d.restart_timeout_s)


def config_from_args(a: argparse.Namespace) -> KVTiersConfig:
    import shlex

    if a.hosts and (bad := [n for n in a.configs if not n.startswith("1p1d")]):
        raise ValueError(f"--hosts runs the 1P1D configurations only, not {', '.join(bad)}")

    out = a.out or ("bench/results/kvtiers_restart.json" if a.warm_restart else KVTiersConfig.out)
    return KVTiersConfig(
        model=a.model, configs=a.configs, conversations=a.conversations, turns=a.turns, user_len=a.user_len,
        output_len=a.output_len, range_ratio=a.range_ratio, think_time_s=a.think_time, rate=a.rate, seed=a.seed,
        num_warmups=a.num_warmups, l1_tokens=a.l1_tokens, working_set_ratio=a.working_set_ratio,
        host_cache_gb=a.kv_host_cache_gb, disk_cache_gb=a.kv_disk_cache_gb, disk_root=a.disk_root,
        slo=SLO.parse(a.slo), dtype=a.dtype, up_args=tuple(shlex.split(a.up_args)), vllm_venv=a.vllm_venv,
        vllm_max_model_len=a.vllm_max_model_len, vllm_args=tuple(shlex.split(a.vllm_args)),
        start_timeout_s=a.start_timeout, out=out, progress=not a.no_progress,
        restart_after_turn=a.restart_after_turn, restart_timeout_s=a.restart_timeout, hosts=a.hosts,
        link_mbit=a.link_mbit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.serve.kvtiers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="WARNING")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
        if args.warm_restart:
            from tandem.bench.serve import kvtiers_restart

            kvtiers_restart.run_warm_restart(cfg)
        else:
            run_kvtiers(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
