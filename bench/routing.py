"""KV-aware routing and conditional disaggregation, measured on real stacks (`tandem up`).

    python -m tandem.bench.routing shared-prefix --out bench/results/routing_shared_prefix.json
    python -m tandem.bench.routing short-prompts --out bench/results/routing_short_prompts.json

`shared-prefix`: `tandem bench serve --dataset-name shared-prefix` (16 groups x 1,024-token prefix +
64 unique tokens, 64 out) against `--prefill 2 --decode 2` once per router policy.
`short-prompts`: two threads keep sending ~1,500-token prompts while short prompts (<= 64 tokens) are
sent one at a time; TTFT of the short ones and ITL of the long ones' streams, for conditional
disaggregation on (`--local-prefill-max-tokens`), off, and a co-located worker. Writes one JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from tandem.bench.flags import add_load_flags, add_out_flag
from tandem.bench.results import write_result
from tandem.bench.serve.procs import start_tandem_up
from tandem.v1 import generation_pb2, generation_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]


class Up:
    """`tandem up` in the background until `close()`; `addr` is the router's gRPC address."""

    def __init__(self, *args: str, timeout_s: float = 600.0):
        self._proc, self.info = start_tandem_up(["--port", "0", "--gateway-port", "-1", "--quiet", *args], timeout_s)
        self.addr = self.info["router"]

    def close(self) -> None:
        self._proc.stop(60.0)


def shared_prefix(args) -> dict:
    out = {}
    for policy in args.policies.split(","):
        # Local prefill off: the policies are compared on the prefill workers (--up-arg may turn it on).
        up = Up("--prefill", "2", "--decode", "2", "--policy", policy, "--local-prefill-max-tokens", "-1",
                *args.up_args)
        try:
            res = ROOT / "bench" / "results" / f"routing_shared_prefix_{policy}.json"
            subprocess.run([sys.executable, "-P", "-m", "tandem.cli", "bench", "serve", "--backend", "tandem-grpc",
                            "--base-url", up.addr, "--dataset-name", "shared-prefix", "--num-prefix-groups", "16",
                            "--prefix-len", "1024", "--input-len", "64", "--output-len", "64",
                            "--num-prompts", str(args.num_prompts), "--request-rate", str(args.rate),
                            "--slo", args.slo, "--no-plot", "--no-progress", "--out", str(res)],
                           check=True, cwd=ROOT)
            m = json.loads(res.read_text())
            m = m["runs"][0]["metrics"] if "runs" in m else m
            out[policy] = {"ttft_p50_ms": m["ttft"]["percentiles"]["p50"], "goodput": m["goodput"],
                           "request_throughput": m["request_throughput"],
                           "cached_token_ratio": m["cached_token_ratio"], "failed": m["failed"]}
            print(policy, out[policy], flush=True)
        finally:
            up.close()
    return out


def _stream(stub, ids: list[int], max_tokens: int) -> tuple[float, list[float]]:
    req = generation_pb2.GenerateRequest(sampling=generation_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    req.token_ids.ids.extend(ids)
    start, times = time.perf_counter(), []
    for chunk in stub.Generate(req, timeout=600):
        if chunk.token_ids:
            times.append(time.perf_counter())
    return times[0] - start, [b - a for a, b in zip(times, times[1:], strict=False)]


def _long_prompts(stub, seed: int, stop: threading.Event, itl: list[float]) -> None:
    """Background load: ~1,500-token prompts, 32 tokens out, one after another; their ITLs go to `itl`."""
    r = random.Random(seed)
    while not stop.is_set():
        itl.extend(_stream(stub, [r.randrange(100, 40000) for _ in range(1500)], 32)[1])


SETUPS = {
    "on": ["--prefill", "2", "--decode", "2"],  # + --local-prefill-max-tokens --local-max
    "off": ["--prefill", "2", "--decode", "2", "--local-prefill-max-tokens", "-1"],
    "off-fcfs": ["--prefill", "2", "--decode", "2", "--local-prefill-max-tokens", "-1",
                 "--prefill-schedule-policy", "fcfs"],
    "colocated": ["--mode", "colocated"],
}


def short_prompts(args) -> dict:
    out = {}
    for name in args.setups.split(","):
        flags = SETUPS[name] + (["--local-prefill-max-tokens", str(args.local_max)] if name == "on" else [])
        up = Up(*flags, *args.up_args)
        rng = random.Random(0)
        stop = threading.Event()
        itl: list[float] = []
        try:
            stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(up.addr))
            threads = [threading.Thread(target=_long_prompts, args=(stub, i, stop, itl), daemon=True)
                       for i in range(2)]
            for t in threads:
                t.start()
            time.sleep(args.warmup_s)
            res = out[name] = {}
            for lens in args.short_lens.split(","):
                lo, hi = (int(x) for x in (lens.split("-") if "-" in lens else (lens, lens)))
                ttfts = []
                for _ in range(args.num_short):
                    n = rng.randrange(lo, hi + 1)
                    ttfts.append(_stream(stub, [rng.randrange(100, 40000) for _ in range(n)], 8)[0])
                res[lens] = {"ttft_p50_ms": statistics.median(ttfts) * 1e3,
                             "ttft_ms": [round(x * 1e3, 1) for x in ttfts]}
                print(name, lens, round(res[lens]["ttft_p50_ms"], 1), flush=True)
            stop.set()
            for t in threads:
                t.join()
            res["long_itl_p50_ms"] = statistics.median(itl) * 1e3 if itl else None
            print(name, "long ITL p50", res["long_itl_p50_ms"], flush=True)
        finally:
            stop.set()
            up.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=("shared-prefix", "short-prompts"))
    add_out_flag(p, required=True)
    p.add_argument("--policies", default="round_robin,cache_aware", help="shared-prefix: router policies to compare")
    add_load_flags(p, num_prompts=32, slo="ttft=5s,tpot=500ms",
                   helps={"num_prompts": "shared-prefix: requests per policy", "slo": "shared-prefix: goodput SLO"})
    p.add_argument("--rate", default="1", help="shared-prefix: request rate, req/s (default: 1)")
    p.add_argument("--num-short", type=int, default=8, help="short-prompts: short prompts measured (default: 8)")
    p.add_argument("--local-max", type=int, default=256,
                   help="short-prompts: --local-prefill-max-tokens of the `on` setup (default: 256)")
    p.add_argument("--setups", default="on,off,off-fcfs,colocated",
                   help=f"short-prompts: stacks to measure, of {', '.join(SETUPS)} (default: all)")
    p.add_argument("--short-lens", default="16-64",
                   help="short-prompts: prompt lengths measured, comma-separated N or LO-HI (default: 16-64)")
    p.add_argument("--warmup-s", type=float, default=10.0,
                   help="short-prompts: seconds of background load before measuring (default: 10)")
    p.add_argument("--up-arg", dest="up_args", action="append", default=[],
                   help="extra `tandem up` flag (repeat; e.g. --up-arg=--kv-cache-gb=0.5)")
    args = p.parse_args()
    run = shared_prefix if args.scenario == "shared-prefix" else short_prompts
    result = {"scenario": args.scenario, "argv": sys.argv[1:], "load_before": os.getloadavg(), "results": run(args)}
    result["load_after"] = os.getloadavg()
    write_result(args.out, result, tool="tandem.bench.routing")
    print(json.dumps(result["results"], indent=2))


if __name__ == "__main__":
    main()
