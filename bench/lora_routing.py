"""LoRA-aware routing against a LoRA-blind router on 2P2D (issue [23]): how often workers read an
adapter from disk, and what the requests' TTFT is, under a skewed adapter popularity.

    python -m tandem.bench.lora_routing --out bench/results/lora_routing.json     # ~8 min on 2 cores

One deployment (`tandem up --prefill 2 --decode 2 --enable-lora`, lazy loading, `--max-cpu-loras 2`:
no worker holds more than 2 of the 8 adapters, so placement decides how often they are read again),
with two routers on the same workers: the one `tandem up` starts (`--lora-routing aware`) and a second
one with the same flags but `--lora-routing blind`. N random rank-16 PEFT adapters (bench/lora.py);
each request names one (its `model`), drawn from a Zipf-like popularity (weight 1/k^s of the k-th,
seeded), with random prompt token ids, sent as a Poisson stream through a router's gRPC API.

The stream is cut into blocks: pair i sends the same seeded requests through both routers, one after
the other, aware first in even pairs and blind first in odd ones (ABBA...), so a drift of the shared
machine and the state one block leaves the next weigh on both. Between blocks every request has
finished. Per block, each worker's `tandem_lora_loads_total` / `tandem_lora_evictions_total` before
and after (a delta; summed over workers, split prefill / decode). Per policy: loads per minute
(the loads of its blocks over their wall time), TTFT p50/p99 of its completed requests, completed and
failed (a worker whose loaded adapters all have requests refuses a request of another one at once:
RESOURCE_EXHAUSTED). Unmeasured warm-ups first (through the first block's router). Local prefill is
off by default (`--local-prefill-max-tokens -1`), so that every request uses a prefill and a decode
worker. Writes one JSON and, with matplotlib, a PNG of the latency CDFs per policy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

from tandem.bench.flags import add_load_flags, add_out_flag, add_stack_flags
from tandem.bench.kv_reuse import metric
from tandem.bench.lora import make_adapters
from tandem.bench.results import write_result
from tandem.bench.serve import plots
from tandem.bench.serve.backends import BackendConfig, TandemGrpcBackend
from tandem.bench.serve.metrics import LatencyStats
from tandem.bench.serve.procs import start_tandem_up
from tandem.bench.serve.records import BenchRequest
from tandem.bench.serve.runner import LoadConfig, run_load, run_warmups
from tandem.bench.serve.serve import cdf_values

POLICIES = ("aware", "blind")
COUNTERS = {"loads": "tandem_lora_loads_total", "evictions": "tandem_lora_evictions_total"}
NOISE = ("a shared 2-core box (other jobs ran meanwhile: see load_before / load_after): "
         "compare the policies within this run, block by block, not with other runs")


def popularity(n: int, s: float) -> list[float]:
    """Zipf-like weights of n adapters, most popular first, summing to 1."""
    w = [1.0 / (k + 1) ** s for k in range(n)]
    return [x / sum(w) for x in w]


def workload(names: list[str], weights: list[float], n: int, input_len: int, max_tokens: int,
             rng: random.Random) -> list[BenchRequest]:
    """n requests, each naming an adapter drawn by `weights`, with random prompt token ids."""
    out = []
    for name in rng.choices(names, weights, k=n):
        ids = tuple(rng.randrange(100, 40000) for _ in range(input_len))
        out.append(BenchRequest(prompt="", prompt_len=input_len, output_len=max_tokens, prompt_ids=ids, model=name))
    return out


def counts(workers: list[dict]) -> dict[str, dict]:
    """Each worker's role and LoRA counters now (its /metrics)."""
    return {w["worker_id"]: {"role": w["role"], **{k: metric(f"http://127.0.0.1:{w['metrics_port']}/metrics", name)
                                                   for k, name in COUNTERS.items()}} for w in workers}


def delta(before: dict[str, dict], after: dict[str, dict]) -> dict:
    """What the counters gained, in all and per role."""
    out: dict = {k: 0 for k in COUNTERS}
    for wid, now in after.items():
        for k in COUNTERS:
            gained = int(now[k] - before[wid][k])
            out[k] += gained
            out[f"{now['role']}_{k}"] = out.get(f"{now['role']}_{k}", 0) + gained
    return out


class Blind:
    """A second router on the deployment's registry: the flags `tandem up` gave its own, but blind."""

    def __init__(self, up_argv: list[str], redis_url: str, env: dict[str, str]):
        from tandem.cli.main import build_parser
        from tandem.cli.up_cmd import up_config
        from tandem.services.launcher.procs import Child, python_cmd
        from tandem.services.launcher.up import router_argv

        argv = router_argv(up_config(build_parser().parse_args(["up", *up_argv])), 0, redis_url)
        self.child = Child("router-blind", python_cmd(*argv, "--lora-routing", "blind"), env=env)
        self.child.start()
        try:
            self.addr = self.child.wait_ready(60.0)["grpc_addr"]
        except RuntimeError:
            self.close()
            raise

    def close(self) -> None:
        self.child.terminate()
        if not self.child.wait(30.0):
            self.child.kill()
            self.child.wait(10.0)


async def block(addr: str, requests: list[BenchRequest], rate: float, seed: int, workers: list[dict],
                warmups: list[BenchRequest]) -> tuple[dict, list[dict]]:
    backend = TandemGrpcBackend(BackendConfig(base_url=addr, timeout_s=300.0))
    await backend.start()
    try:
        await run_warmups(backend, warmups)
        before = counts(workers)
        run = await run_load(backend, requests, LoadConfig(request_rate=rate, seed=seed))
    finally:
        await backend.close()
    await asyncio.sleep(1.0)   # the workers' export follows their registry each engine-loop tick
    records = [{"adapter": req.model, **r.to_dict(run.t0)} for req, r in zip(requests, run.records, strict=True)]
    row = {"duration_s": round(run.duration_s, 2), **delta(before, counts(workers))}
    return row, records


def summary(rows: list[dict], records: list[dict]) -> dict:
    minutes = sum(r["duration_s"] for r in rows) / 60.0
    ok = [r for r in records if r["success"]]
    ttft = LatencyStats.of([r["ttft_ms"] / 1e3 for r in ok])
    tpot = LatencyStats.of([r["tpot_ms"] / 1e3 for r in ok if r["tpot_ms"] is not None])
    e2e = LatencyStats.of([r["e2e_ms"] / 1e3 for r in ok])
    errors: dict[str, int] = {}
    for r in records:
        if not r["success"]:
            code = r["error"].split(":", 1)[0]
            errors[code] = errors.get(code, 0) + 1
    out = {"blocks": len(rows), "minutes": round(minutes, 2), "completed": len(ok), "failed": len(records) - len(ok),
           "errors": errors, "ttft_p50_ms": round(ttft.p(50), 1), "ttft_p99_ms": round(ttft.p(99), 1),
           "ttft_mean_ms": round(ttft.mean, 1), "tpot_p50_ms": round(tpot.p(50), 1),
           "e2e_p50_ms": round(e2e.p(50), 1)}
    for k in [k for k in rows[0] if k != "duration_s"]:
        total = sum(r[k] for r in rows)
        out[k] = total
        out[f"{k}_per_min"] = round(total / minutes, 2)
    return out


def run(args, up_argv: list[str], names: list[str]) -> dict:
    from tandem.services.common.auth import deployment_env

    env = deployment_env(os.environ, None)   # the deployment's internal secret: the second router's too
    proc, info = start_tandem_up(up_argv, args.start_timeout, env=env)
    blind = None
    try:
        blind = Blind(up_argv, info["redis_url"], env)
        addrs = {"aware": info["router"], "blind": blind.addr}
        weights = popularity(len(names), args.zipf)
        rows: list[dict] = []
        records: dict[str, list[dict]] = {p: [] for p in POLICIES}
        for pair in range(args.pairs):
            reqs = workload(names, weights, args.num_prompts, args.input_len, args.max_tokens,
                            random.Random(args.seed * 1000 + pair))
            order = POLICIES if pair % 2 == 0 else POLICIES[::-1]
            for policy in order:
                warm = workload(names, weights, args.num_warmups, args.input_len, args.max_tokens,
                                random.Random(-1 - args.seed)) if not rows else []
                row, recs = asyncio.run(block(addrs[policy], reqs, args.request_rate, args.seed + pair,
                                              info["workers"], warm))
                ok = [r["ttft_ms"] for r in recs if r["success"]]
                p50 = round(LatencyStats.of([x / 1e3 for x in ok]).p(50), 1)
                rows.append({"pair": pair, "policy": policy, **row, "completed": len(ok), "ttft_p50_ms": p50})
                records[policy] += recs
                print(f"pair {pair} {policy:>5}: {row['loads']} loads ({row.get('prefill_loads', 0)} P, "
                      f"{row.get('decode_loads', 0)} D), {row['evictions']} evictions in {row['duration_s']:.0f} s; "
                      f"{len(ok)}/{len(recs)} completed, TTFT p50 {p50} ms", flush=True)
    finally:
        if blind is not None:
            blind.close()
        proc.stop(60.0)
    counted = ("loads", "evictions", "prefill_loads", "decode_loads", "prefill_evictions", "decode_evictions",
               "duration_s")
    policies = {p: summary([{k: r.get(k, 0) for k in counted} for r in rows if r["policy"] == p], records[p])
                for p in POLICIES}
    return {"weights": [round(w, 4) for w in weights], "blocks": rows, "policies": policies, "records": records}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_load_flags(p, request_rate=1.0, num_prompts=60, input_len=64, seed=0, max_tokens=16, num_warmups=16,
                   helps={"num_prompts": "requests per block (each pair of blocks: the same ones through both "
                                         "routers)", "num_warmups": "unmeasured requests before the first block"})
    add_stack_flags(p, model="smollm2-135m", up_args="--local-prefill-max-tokens -1", start_timeout=600.0)
    p.add_argument("--pairs", type=int, default=2, help="pairs of blocks, aware and blind (default: 2)")
    p.add_argument("--adapters", type=int, default=8, help="random PEFT adapters (default: 8)")
    p.add_argument("--rank", type=int, default=16, help="their LoRA rank, on all seven projections (default: 16)")
    p.add_argument("--zipf", type=float, default=1.1,
                   help="popularity exponent s: the k-th adapter is asked for with weight 1/k^s (default: 1.1)")
    p.add_argument("--max-cpu-loras", type=int, default=2, help="adapters each worker keeps loaded (default: 2)")
    p.add_argument("--max-loras", type=int, default=2, help="distinct adapters in one step (default: 2)")
    add_out_flag(p, "bench/results/lora_routing.json")
    args = p.parse_args()
    from tandem.engine.models.source import resolve_model

    load_before = os.getloadavg()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tandem-bench-lora-routing-") as tmp:
        paths = make_adapters(resolve_model(args.model), Path(tmp), args.adapters, args.rank)
        up_argv = ["--port", "0", "--gateway-port", "-1", "--quiet", "--prefill", "2", "--decode", "2",
                   "--model", args.model, "--enable-lora", "--max-loras", str(args.max_loras),
                   "--max-cpu-loras", str(args.max_cpu_loras), "--max-lora-rank", str(args.rank),
                   "--lora-routing", "aware", *(x for n, path in paths.items() for x in ("--lora-modules", f"{n}={path}")),
                   *shlex.split(args.up_args)]
        result = run(args, up_argv, list(paths))
    out = Path(args.out)
    doc = {"bench": "lora_routing", "model": args.model, "adapters": args.adapters, "rank": args.rank,
           "zipf": args.zipf, "max_cpu_loras": args.max_cpu_loras, "max_loras": args.max_loras,
           "request_rate": args.request_rate, "num_prompts": args.num_prompts, "pairs": args.pairs,
           "input_len": args.input_len, "max_tokens": args.max_tokens, "seed": args.seed, "up_args": args.up_args,
           "cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg(),
           "wall_s": round(time.monotonic() - t0, 1), "noise": NOISE, **result}
    write_result(out, doc, tool="tandem.bench.lora_routing")
    png = plots.plot_cdfs({p: cdf_values(result["records"][p]) for p in POLICIES}, out.with_suffix(".png"),
                          title=f"LoRA routing, 2P2D, {args.adapters} adapters (Zipf {args.zipf})")
    for policy, s in result["policies"].items():
        print(f"{policy:>5}: {s['loads_per_min']} loads/min ({s['loads']} in {s['minutes']} min), "
              f"{s['evictions_per_min']} evictions/min; TTFT p50 {s['ttft_p50_ms']} ms, p99 {s['ttft_p99_ms']} ms, "
              f"TPOT p50 {s['tpot_p50_ms']} ms; "
              f"{s['completed']} completed, {s['failed']} failed {s['errors'] or ''}")
    print(f"note: {NOISE}\nwrote {out}" + (f" and {png}" if png else ""), file=sys.stderr)


if __name__ == "__main__":
    main()
