"""Serving LoRA adapters side by side with vLLM's CPU backend: the same batches sent to Tandem
(`tandem up --mode colocated`) and to vLLM (`make vllm-venv`), both with the same 8 random rank-16
adapters (PEFT, all seven projections, bench/lora.py's), over each server's OpenAI
`/v1/completions`, streamed (issue [23]: "the same workload on vLLM's CPU backend with its LoRA
support side by side").

    python -m tandem.bench.lora_serve --out bench/results/lora_serve.json     # ~10 min on 2 cores

Per server and batch size B (default 8 and 32): B requests at once of `--input-len` random token ids
and `--max-tokens` tokens each (greedy, ignore_eos), first all on the base model, then each on one of
the adapters in turn (mixed). TPOT of a request = (last token's arrival - first token's) / (tokens -
1); a row is the median over its requests, best of `--repeats` rounds. The ratio that matters is
mixed / base on each server (what serving adapters costs it); the absolute TPOTs compare the two.
Both servers get every adapter loaded before timing (a warm-up round per adapter), the same KV
space and dtype, and the machine to themselves one after the other.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

from tandem.bench.flags import add_load_flags, add_out_flag
from tandem.bench.lora import make_adapters
from tandem.bench.results import write_result
from tandem.bench.serve.procs import start_tandem_up
from tandem.engine.models.source import resolve_model


def stream_tpot(base_url: str, model: str, prompt: list[int], max_tokens: int) -> float:
    """One streamed completion; its TPOT in ms (every chunk carries one token here: ignore_eos)."""
    url = urlparse(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{model}: HTTP {resp.status}: {resp.read()[:300]!r}")
    times = []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            times.append(time.perf_counter())
    conn.close()
    if len(times) < 2:
        raise RuntimeError(f"{model}: {len(times)} tokens streamed")
    return (times[-1] - times[0]) / (max_tokens - 1) * 1e3   # chunks may merge tokens: count what was asked


def batch_tpot(base_url: str, models: list[str], prompts: list[list[int]], max_tokens: int) -> float:
    with ThreadPoolExecutor(len(models)) as pool:
        tpots = list(pool.map(lambda mp: stream_tpot(base_url, mp[0], mp[1], max_tokens), zip(models, prompts, strict=True)))
    return statistics.median(tpots)


def measure(label: str, base_url: str, base_model: str, adapters: list[str], args, rng: random.Random) -> list[dict]:
    vocab = json.loads((resolve_model(args.model) / "config.json").read_text())["vocab_size"]
    for name in adapters:                               # every adapter loaded before anything is timed
        stream_tpot(base_url, name, [rng.randrange(3, vocab) for _ in range(16)], 4)
    rows = []
    for b in map(int, args.batches.split(",")):
        for case, models in (("base", [base_model] * b),
                             (f"{len(adapters)} adapters mixed", [adapters[i % len(adapters)] for i in range(b)])):
            best = min(batch_tpot(base_url, models, [[rng.randrange(3, vocab) for _ in range(args.input_len)]
                                                     for _ in range(b)], args.max_tokens)
                       for _ in range(args.repeats))
            rows.append({"server": label, "batch": b, "case": case, "tpot_ms": round(best, 2)})
            print(f"{label:>8} batch {b:>3} {case:>18}: TPOT {best:.1f} ms", flush=True)
    base = {r["batch"]: r["tpot_ms"] for r in rows if r["case"] == "base"}
    for r in rows:
        r["tpot_vs_base"] = round(r["tpot_ms"] / base[r["batch"]], 3)
    return rows


def tandem_rows(args, paths: dict[str, Path], rng: random.Random) -> list[dict]:
    lora = [a for n, p in paths.items() for a in ("--lora-modules", f"{n}={p}")]
    proc, info = start_tandem_up(
        ["--model", args.model, "--dtype", args.dtype, "--mode", "colocated", "--port", "0", "--gateway-port", "0",
         "--kv-cache-gb", "1", "--quiet", "--enable-lora", *lora, "--max-loras", str(len(paths)),
         "--max-lora-rank", str(args.rank), "--max-running-requests", "64"], timeout_s=600)
    try:
        return measure("tandem", info["gateway"], args.model, list(paths), args, rng)
    finally:
        proc.stop()


def vllm_rows(args, paths: dict[str, Path], rng: random.Random) -> list[dict]:
    from tandem.bench.serve.sweep import DeploymentUnavailable, SweepConfig, VllmServe

    flags = ("--enable-lora", "--max-loras", str(len(paths)), "--max-lora-rank", str(args.rank),
             "--max-cpu-loras", str(len(paths)), "--lora-modules", *(f"{n}={p}" for n, p in paths.items()))
    server = VllmServe(SweepConfig(model=args.model, dtype=args.dtype, vllm_kv_cache_gb=1, vllm_args=flags))
    try:
        endpoint = server.start()
    except DeploymentUnavailable as e:
        print(f"vLLM with LoRA did not start: {e}", flush=True)
        return [{"server": "vllm", "error": str(e)[-2000:]}]
    try:
        return measure("vllm", endpoint.base_url, endpoint.model, list(paths), args, rng)
    finally:
        server.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_load_flags(ap, seed=0, input_len=128, max_tokens=64)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16", help="both servers' dtype (vLLM's CPU default is bf16)")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="rounds per row (the best is kept)")
    ap.add_argument("--servers", default="tandem,vllm")
    add_out_flag(ap)
    args = ap.parse_args()
    servers = args.servers.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-lora-serve-") as tmp:
        paths = make_adapters(resolve_model(args.model), Path(tmp), args.adapters, args.rank)
        if "tandem" in servers:
            rows += tandem_rows(args, paths, random.Random(args.seed))
        if "vllm" in servers:
            rows += vllm_rows(args, paths, random.Random(args.seed))
    if args.out:
        write_result(args.out, {"bench": "lora_serve", "model": args.model, "dtype": args.dtype, "rank": args.rank,
                                "adapters": args.adapters, "input_len": args.input_len,
                                "max_tokens": args.max_tokens, "rows": rows}, tool="tandem.bench.lora_serve")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
