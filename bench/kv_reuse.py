"""KV both ways on a multi-turn workload: 1P1D with KV tiers, the prefill worker fetching the earlier
answers from the decode worker (--kv-reuse-policy auto) vs computing them again (never); on one host
and with P and D on hosts of their own (network namespaces, tandem.bench.cluster) behind a shaped
1 Gbit/s link (tc tbf on the prefill host). The cross-host part needs root.

    python -m tandem.bench.kv_reuse --out bench/results/kv_reuse.json      # ~10 min on 2 cores

Conversations run one at a time (closed loop, no think time), so each TTFT is one request's own:
turn 1 is `--user-len` fresh token ids; turn k+1 is turn k's prompt, its answer (`--answer-len`
tokens, greedy, EOS ignored) and `--user-len` new ones, sent as token ids to the router over gRPC
and streamed. Every prompt prefills on P (`--local-prefill-max-tokens -1`: with a decode worker that
holds most of the prompt the router would otherwise often prefill it there). Per configuration: TTFT
p50/p90 of turns >= 2, and the prompt tokens P computed for them (prompt - the cached tokens the
usage reports: P's own prefix cache plus what it fetched); the worker metrics' fetched tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
import urllib.request

import grpc

from tandem.bench.flags import add_load_flags, add_out_flag
from tandem.bench.results import write_result
from tandem.bench.serve.procs import start_tandem_up
from tandem.v1 import generation_pb2, generation_pb2_grpc

POLICIES = ("never", "auto")


def converse(router: str, conversations: int, turns: int, user_len: int, answer_len: int,
             seed: int) -> list[dict]:
    """Run the conversations one at a time; one record per turn."""
    rng = random.Random(seed)
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(router))
    rows = []
    for c in range(conversations):
        prompt: list[int] = []
        for t in range(turns):
            prompt += [rng.randrange(1000, 40000) for _ in range(user_len)]
            req = generation_pb2.GenerateRequest(sampling=generation_pb2.SamplingParams(
                max_tokens=answer_len, temperature=0.0, ignore_eos=True))
            req.token_ids.ids.extend(prompt)
            t0, first, answer, usage = time.perf_counter(), None, [], None
            for chunk in stub.Generate(req, timeout=300):
                if first is None and chunk.token_ids:
                    first = time.perf_counter() - t0
                answer += chunk.token_ids
                if chunk.HasField("usage"):
                    usage = chunk.usage
            rows.append({"conversation": c, "turn": t + 1, "prompt_tokens": len(prompt), "ttft_s": first,
                         "cached_tokens": usage.cached_tokens, "computed_by_p": len(prompt) - usage.cached_tokens})
            prompt += answer
    return rows


def wait_serving(router: str, timeout_s: float = 120.0) -> None:
    """Until the router serves a 1-token request (its registry has seen both workers)."""
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(router))
    req = generation_pb2.GenerateRequest(sampling=generation_pb2.SamplingParams(max_tokens=1))
    req.token_ids.ids.extend([1000, 1001])
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            list(stub.Generate(req, timeout=60))
            return
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def summary(rows: list[dict]) -> dict:
    later = [r for r in rows if r["turn"] >= 2]
    ttft = [r["ttft_s"] for r in later]
    return {"turn2plus_ttft_p50_ms": 1e3 * statistics.median(ttft),
            "turn2plus_ttft_p90_ms": 1e3 * statistics.quantiles(ttft, n=10)[-1],
            "turn2plus_prompt_tokens": sum(r["prompt_tokens"] for r in later),
            "turn2plus_computed_by_p": sum(r["computed_by_p"] for r in later)}


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def one_host(policy: str, args, common: list[str]) -> dict:
    proc, info = start_tandem_up(["--port", "0", "--quiet", "--ready-json", "--gateway-port", "-1",
                                  "--mode", "disagg", "--prefill", "1", "--decode", "1", *common,
                                  "--kv-reuse-policy", policy], timeout_s=300)
    try:
        rows = converse(info["router"], args.conversations, args.turns, args.user_len, args.answer_len, args.seed)
        (p,) = [w for w in info["workers"] if w["role"] == "prefill"]
        fetched = metric(f"http://127.0.0.1:{p['metrics_port']}/metrics", "tandem_kv_fetched_tokens_total")
    finally:
        proc.stop()
    return {"rows": rows, "fetched_tokens": fetched, **summary(rows)}


def across_hosts(policy: str, args, mbit: int) -> dict:
    from tandem.bench.cluster.deploy import Cluster
    from tandem.bench.cluster.net import Network

    router = ("--local-prefill-max-tokens", "-1", "--kv-reuse-policy", policy)
    with Network("reuse") as net, Cluster(net, model=args.model, worker_args=tuple(args.worker_args.split()),
                                          router_args=router, gateway=False) as c:
        wait_serving(c.router_addr)
        net.shape("prefill-0", mbit or None)
        rows = converse(c.router_addr, args.conversations, args.turns, args.user_len, args.answer_len, args.seed)
        net.shape("prefill-0", None)
    return {"mbit": mbit, "rows": rows, **summary(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-len", type=int, default=128)
    ap.add_argument("--answer-len", type=int, default=128)
    ap.add_argument("--mbit", type=int, default=1000, help="the cross-host link (0: unshaped; -1: skip that part)")
    ap.add_argument("--no-one-host", action="store_true", help="only the cross-host part")
    ap.add_argument("--worker-args", default="--kv-host-cache-gb 0.5",
                    help="more flags for both workers (default: an L2 host tier)")
    add_load_flags(ap, seed=0)
    add_out_flag(ap)
    args = ap.parse_args()
    common = ["--model", args.model, "--local-prefill-max-tokens", "-1", *args.worker_args.split()]
    result: dict = {"bench": "kv_reuse", "config": vars(args), "one_host": {}, "across_hosts": {}}
    for policy in () if args.no_one_host else POLICIES:
        result["one_host"][policy] = r = one_host(policy, args, common)
        print(f"one host, {policy:>5}: turn>=2 TTFT p50 {r['turn2plus_ttft_p50_ms']:.0f} ms, "
              f"p90 {r['turn2plus_ttft_p90_ms']:.0f} ms; P computed {r['turn2plus_computed_by_p']} of "
              f"{r['turn2plus_prompt_tokens']} prompt tokens; fetched {r['fetched_tokens']:.0f}", flush=True)
    if args.mbit >= 0:
        for policy in POLICIES:
            with contextlib.suppress(PermissionError):
                result["across_hosts"][policy] = r = across_hosts(policy, args, args.mbit)
                print(f"{args.mbit or 'unshaped'} Mbit, {policy:>5}: turn>=2 TTFT p50 "
                      f"{r['turn2plus_ttft_p50_ms']:.0f} ms, p90 {r['turn2plus_ttft_p90_ms']:.0f} ms; P computed "
                      f"{r['turn2plus_computed_by_p']} of {r['turn2plus_prompt_tokens']}", flush=True)
    ratios = {where: part["auto"]["turn2plus_ttft_p50_ms"] / part["never"]["turn2plus_ttft_p50_ms"]
              for where, part in (("one_host", result["one_host"]), ("across_hosts", result["across_hosts"]))
              if len(part) == 2}
    result["ttft_p50_reuse_over_recompute"] = ratios
    for where, v in ratios.items():
        print(f"{where}: turn>=2 TTFT p50 with reuse {v:.2f}x without")
    if args.out:
        write_result(args.out, result, tool="tandem.bench.kv_reuse")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
