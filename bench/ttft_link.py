"""TTFT of disaggregated serving across hosts: 1P1D with P and D on hosts of their own (network
namespaces, tandem.bench.cluster), the prefill host's link unshaped and shaped (tc tbf), one request
at a time. Needs root.

    python -m tandem.bench.ttft_link --out bench/results/ttft_link.json     # ~5 min on 2 cores

Each request is a fresh `--input-len`-token prompt (random token ids: nothing is cached anywhere),
`max_tokens` 1, streamed through the gateway; TTFT = request sent -> first token received. The router
runs with `--local-prefill-max-tokens -1`, so every prompt prefills on P and its KV crosses P's link
(the prefill host's link is the one shaped: the KV goes P -> D over it). Per rate: TTFT p50/p90, the
decode side's KV transfer time (first byte -> aux record, worker metrics), and TTFT p50 / unshaped p50
(targets, issue [22]: <= 1.05 at 10 Gbit, <= 1.15 at 1 Gbit).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import time

from tandem.bench.chaos_net import transfer_ms
from tandem.bench.cluster.deploy import Cluster
from tandem.bench.cluster.net import Network
from tandem.bench.flags import add_load_flags, add_out_flag
from tandem.bench.results import write_result

TARGETS = {10000: 1.05, 1000: 1.15}


def ttft(url: str, ids: list[int], timeout_s: float = 120.0) -> float:
    """Seconds from sending a streamed completion of prompt `ids` to its first token."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    body = json.dumps({"prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True}).encode()
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        while line := resp.readline():
            if line.startswith(b"data: ") and b'"text"' in line:
                elapsed = time.perf_counter() - t0
                resp.read()
                return elapsed
        raise RuntimeError("the stream ended without a token")
    finally:
        conn.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_load_flags(ap, input_len=1024, num_prompts=12, seed=0)
    ap.add_argument("--mbit", default="0,10000,1000", help="prefill host link rates; 0 = unshaped")
    ap.add_argument("--warmup", type=int, default=2, help="requests before each rate's timed ones")
    ap.add_argument("--worker-args", default="", help="more flags for both workers, e.g. '--dtype float32'")
    add_out_flag(ap)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    rates = [int(r) for r in args.mbit.split(",")]

    def prompt() -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(args.input_len)]

    rows = []
    router_args = ("--local-prefill-max-tokens", "-1")
    worker_args = ("--transfer-backend", "auto", *args.worker_args.split())
    with Network("ttft") as net, Cluster(net, prefill=1, decode=1, worker_args=worker_args,
                                         router_args=router_args) as c:
        for mbit in rates:
            net.shape("prefill-0", mbit or None)
            for _ in range(args.warmup):
                ttft(c.gateway_url, prompt())
            before = transfer_ms(c)
            ts = [ttft(c.gateway_url, prompt()) for _ in range(args.num_prompts)]
            ms, rooms = (a - b for a, b in zip(transfer_ms(c), before, strict=True))
            row = {"mbit": mbit, "ttft_p50_ms": 1e3 * statistics.median(ts),
                   "ttft_p90_ms": 1e3 * statistics.quantiles(ts, n=10)[-1], "ttft_ms": [1e3 * t for t in ts],
                   "kv_transfer_mean_ms": ms / rooms if rooms else None}
            rows.append(row)
            print(f"{mbit or 'unshaped':>9} Mbit: TTFT p50 {row['ttft_p50_ms']:.0f} ms, p90 {row['ttft_p90_ms']:.0f} ms, "
                  f"KV transfer {row['kv_transfer_mean_ms'] or float('nan'):.0f} ms", flush=True)
        net.shape("prefill-0", None)
    base = next((r["ttft_p50_ms"] for r in rows if r["mbit"] == 0), None)
    ratios = {str(r["mbit"]): r["ttft_p50_ms"] / base for r in rows if base and r["mbit"]}
    targets = {f"ttft_{m}<={b}x_unshaped": ratios[str(m)] <= b for m, b in TARGETS.items() if str(m) in ratios}
    for m, v in ratios.items():
        print(f"{m} Mbit: TTFT p50 {v:.2f}x unshaped")
    if args.out:
        write_result(args.out, {"bench": "ttft_link", "input_len": args.input_len, "requests": args.num_prompts,
                                "worker_args": list(worker_args), "rows": rows, "ratio_to_unshaped": ratios,
                                "targets_met": targets}, tool="tandem.bench.ttft_link")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
