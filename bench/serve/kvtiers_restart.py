"""`python -m tandem.bench.serve.kvtiers --warm-restart`: a co-located worker killed mid-run comes back warm from L3.

Two runs of the same seeded multi-turn workload (kvtiers.py's flags), co-located Tandem with the same
L1 budget: `restart-l3` with the tiers (L2 + L3 in a fresh directory) and `restart-no-l3` without. In
each, once half the conversations have finished turn `--restart-after-turn`, the worker process (not
`tandem up`) gets SIGKILL; `tandem up`'s supervisor starts it again with the same flags, so the same
`--kv-disk-cache-dir` (services/launcher/supervisor.py), and prints `TANDEM_RESTARTED {json}` once it is
ready. Meanwhile no new request is sent, and a request that failed because of the kill is sent again
once the worker is back (counted as `retried`); one unrelated warm-up request goes first (a fresh
process's first request pays for its own start-up, ~2 s here, which is not what is measured). Reported per run: when it was killed and back, and for
each conversation its first turn >= 2 sent after that: TTFT and the share of its prompt the server
reported as cached (`usage.prompt_tokens_details.cached_tokens`); then the same turns across the two runs.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tandem.bench.results import write_result
from tandem.bench.serve import kvtiers, multiturn
from tandem.bench.serve import kvtiers_report as report
from tandem.bench.serve.backends import Backend, BackendConfig, make_backend
from tandem.bench.serve.datasets import load_tokenizer
from tandem.bench.serve.metrics import compute_metrics, multi_turn_metrics
from tandem.bench.serve.records import BenchRequest, RequestRecord
from tandem.bench.serve.runner import LoadConfig
from tandem.bench.serve.serve import WARMUP_SEED_OFFSET, config_dict, machine_info
from tandem.bench.serve.sweep import Endpoint, _terminate_as_exit, measure_deployment

RESTARTED_PREFIX = "TANDEM_RESTARTED "   # `tandem up --ready-json`'s line for a restarted process
RUNS = (("restart-l3", "colo-tiers"), ("restart-no-l3", "colo"))   # (run name, kvtiers configuration)


def turn_of(req: BenchRequest) -> int:
    """A multi-turn request's turn (1-based): its history holds 2k - 1 messages."""
    return (len(req.messages) + 1) // 2 if req.messages else 1


class KillOnce:
    """A backend that, once `count` requests of turn `turn` have succeeded, calls `kill()` (the worker
    dies) and holds every request until `wait_back()` (blocking, run in a thread) returns. A request that
    failed while the kill happened is sent again once the worker is back; others are returned as they are.
    Times (`killed_at`, `back_at`) are perf_counter seconds, like the records'."""

    def __init__(self, inner: Backend, turn: int, count: int, kill: Callable[[], None], wait_back: Callable[[], None],
                 warmup: BenchRequest | None = None):
        self.inner, self.turn, self.count = inner, turn, count
        self.kill, self.wait_back = kill, wait_back
        self.warmup = warmup               # sent alone once the worker is back, before the held requests
        self.warmup_record: RequestRecord | None = None
        self.done = 0                      # successes of turn `turn` so far
        self.epoch = 0                     # bumped by the kill: a request that spans it is retried
        self.retried = 0
        self.killed_at: float | None = None
        self.back_at: float | None = None
        self.back_error = ""
        self._open: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        await self.inner.start()

    async def close(self) -> None:
        if self._task is not None:
            await self._task
        await self.inner.close()

    async def send(self, req: BenchRequest) -> RequestRecord:
        assert self._open is not None, "start() first"
        while True:
            await self._open.wait()
            epoch = self.epoch
            rec = await self.inner.send(req)
            if not rec.success and epoch != self.epoch:
                self.retried += 1          # in flight when the worker was killed
                continue
            if rec.success and self.killed_at is None and turn_of(req) == self.turn:
                self.done += 1
                if self.done >= self.count:
                    self._kill()
            return rec

    def _kill(self) -> None:
        self._open.clear()                 # before the kill: nothing new reaches a dying worker
        self.epoch += 1
        self.killed_at = time.perf_counter()
        self.kill()
        self._task = asyncio.create_task(self._reopen())

    async def _reopen(self) -> None:
        try:
            await asyncio.to_thread(self.wait_back)
            if self.warmup is not None:    # a fresh process's first request pays its own start-up, not the cache's
                self.warmup_record = await self.inner.send(self.warmup)
        except Exception as e:             # not back: the rest of the run fails and says so
            self.back_error = f"{type(e).__name__}: {e}"
        finally:
            self.back_at = time.perf_counter()
            self._open.set()


class RestartWatch:
    """Reads `tandem up`'s output for the killed worker's `TANDEM_RESTARTED` line."""

    def __init__(self):
        self.worker = ""                   # the supervised process's name, once known
        self.ready: dict = {}              # the restarted worker's READY JSON (its new metrics port)
        self.back = threading.Event()

    def on_line(self, line: str) -> None:
        at = line.find(RESTARTED_PREFIX)
        if at < 0:
            return
        msg = json.loads(line[at + len(RESTARTED_PREFIX):])
        if msg.get("name") == self.worker:
            self.ready = msg.get("ready") or {}
            self.back.set()


def _worker(info: dict) -> tuple[str, int]:
    """The (supervised name, pid) of the one co-located worker of a `TANDEM_UP` summary."""
    pid = info["workers"][0]["pid"]
    names = [n for n, p in info.get("pids", {}).items() if p == pid]
    assert names, f"worker pid {pid} is not among `tandem up`'s processes {info.get('pids')}"
    return names[0], pid


def _wait_healthy(url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health did not answer 200 in time")


def run_once(name: str, config: str, cfg: kvtiers.KVTiersConfig, p: kvtiers.Plan, tokenizer, echo=print) -> dict:
    watch = RestartWatch()
    dep = kvtiers.TandemConfigUp(name, cfg, cfg.sweep_config(p.dtype), p.l1_tokens, config=config,
                                 on_line=watch.on_line)
    dataset = cfg.dataset()

    def run(ep: Endpoint) -> dict:
        watch.worker, pid = _worker(dep.info)

        def kill() -> None:
            echo(f"--- {name}: kill -9 worker {watch.worker} (pid {pid})")
            os.kill(pid, signal.SIGKILL)

        def wait_back() -> None:
            deadline = time.monotonic() + cfg.restart_timeout_s
            if not watch.back.wait(cfg.restart_timeout_s):
                raise TimeoutError(f"{watch.worker} was not restarted in {cfg.restart_timeout_s:.0f} s")
            _wait_healthy(ep.base_url, deadline)

        inner = make_backend(ep.backend, BackendConfig(base_url=ep.base_url, model=ep.model,
                                                       force_output_len=ep.force_output_len))
        # Warm-ups: conversations of their own; the last one is kept for the restarted worker.
        warm = multiturn.warmup_requests(dataset, cfg.num_warmups + 1, cfg.seed + WARMUP_SEED_OFFSET, tokenizer)
        killer = KillOnce(inner, cfg.restart_after_turn, math.ceil(cfg.conversations / 2), kill, wait_back,
                          warmup=warm.pop())

        async def go():
            await killer.start()
            try:
                return await multiturn.run_conversations(killer, p.convs, LoadConfig(cfg.rate, seed=cfg.seed),
                                                         tokenizer, warmups=warm, progress=cfg.progress, desc=name)
            finally:
                await killer.close()

        result = asyncio.run(go())
        if watch.ready:                    # the restarted worker serves its metrics on a port of its own
            dep.info = {**dep.info, "workers": [watch.ready]}
        reqs = [r.to_dict(result.t0) for r in result.records]
        run_dict = {"metrics": compute_metrics(result.records, result.duration_s, cfg.slo).to_dict(),
                    "multi_turn": multi_turn_metrics(result.records, cfg.conversations, cfg.turns).to_dict(),
                    "requests": reqs}
        restart: dict = {"killed": killer.killed_at is not None, "worker": watch.worker, "pid_killed": pid,
                         "trigger": f"{killer.count} conversations finished turn {killer.turn}",
                         "retried_requests": killer.retried, "back_error": killer.back_error,
                         "warmup_after_restart": killer.warmup_record.to_dict(result.t0) if killer.warmup_record else None}
        if killer.killed_at is not None and killer.back_at is not None:
            back_ms = (killer.back_at - result.t0) * 1e3
            firsts = report.first_turns_after(reqs, back_ms)
            restart.update(killed_ms=(killer.killed_at - result.t0) * 1e3, back_ms=back_ms,
                           down_s=killer.back_at - killer.killed_at, first_turns_after=firsts,
                           summary=report.restart_summary(firsts))
        return {"kv_capacity_tokens": dep.kv_capacity(), "kv_tier_hits": dep.tier_hits(), "run": run_dict,
                "restart": restart}

    entry, why = measure_deployment(dep, run, echo)
    return entry if entry is not None else {"skipped": why}


def run_warm_restart(cfg: kvtiers.KVTiersConfig, echo=print) -> dict:
    if not 1 <= cfg.restart_after_turn < cfg.turns:
        raise ValueError(f"--restart-after-turn must be in [1, --turns) = [1, {cfg.turns}), "
                         f"got {cfg.restart_after_turn}: later turns must be left to measure")
    tokenizer = load_tokenizer(cfg.model)
    p = kvtiers.plan(cfg, tokenizer, kvtiers.resolve_dtype(cfg, echo))
    echo(f"workload: {multiturn.describe(p.convs)}; KV budget {p.budget}")
    out = Path(cfg.out)
    results: dict = {"tool": "python -m tandem.bench.serve.kvtiers --warm-restart",
                     "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(),
                     "config": config_dict(cfg), "dtype": p.dtype, "kv_budget": p.budget, "runs": {}}
    with _terminate_as_exit():
        for name, config in RUNS:
            results["runs"][name] = run_once(name, config, cfg, p, tokenizer, echo)
            write_result(out, results, tool="tandem.bench.serve.kvtiers")
    firsts = {n: r.get("restart", {}).get("first_turns_after", []) for n, r in results["runs"].items()}
    results["comparison"] = report.restart_comparison(firsts["restart-l3"], firsts["restart-no-l3"])
    results["table"] = restart_text(results)
    write_result(out, results, tool="tandem.bench.serve.kvtiers")
    out.with_suffix(".md").write_text(results["table"] + "\n")
    echo(results["table"])
    echo(f"results: {out}")
    return results


def restart_text(results: dict) -> str:
    lines = ["| run | killed at s | down s | first turns ≥ 2 after restart | their TTFT p50 / p99 ms | "
             "their prompt cached | retried |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in results["runs"].items():
        rs = r.get("restart", {})
        if "summary" not in rs:
            why = r.get("skipped") or rs.get("back_error") or "the kill did not happen (trigger not reached)"
            lines.append(f"| {name} | - | - | - | - | - | {why.splitlines()[0] if why else ''} |")
            continue
        s = rs["summary"]
        share = "-" if s["cached_share"] is None else f"{s['cached_share']:.0%}"
        lines.append(f"| {name} | {rs['killed_ms'] / 1e3:.1f} | {rs['down_s']:.1f} | {s['completed']} / {s['turns']} | "
                     f"{report.fmt(s['ttft_ms']['p50'])} / {report.fmt(s['ttft_ms']['p99'])} | {share} | "
                     f"{rs['retried_requests']} |")
    c = results["comparison"]
    lines.append(f"same turns in both runs: {c['matched_turns']}, TTFT with L3 / without, p50 of the ratios: "
                 f"{report.fmt(c['ttft_ratio_p50'], 2)}x")
    return "\n".join(lines)
