"""TTFT the HTTP gateway adds over the gRPC SDK, measured on one deployment in one run.

    python -m tandem.bench.gateway --out bench/results/gateway.json            # starts `tandem up` itself
    python -m tandem.bench.gateway --router 127.0.0.1:50051 --gateway http://127.0.0.1:8000

Each round sends the same kind of request three ways, in rotating order, one at a time: the SDK
(`tandem_client.Client.stream`, gRPC straight to the router), the official `openai` package
through the gateway (streaming), and a bare httpx SSE request through the gateway. TTFT is request
start to the first token in the client's hands. Every prompt starts with a unique tag, so no
request hits another's prefix cache. The gateway's cost is `p50(openai) - p50(sdk)`, shown beside
the median of the per-round differences (less sensitive to the shared machine's drift).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx
import openai
from tandem_client import Client

from tandem.bench.flags import add_load_flags, add_out_flag, add_stack_flags
from tandem.bench.results import write_result
from tandem.bench.serve.procs import _Proc, start_tandem_up

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"


def start_stack(model: str, mode: str, timeout_s: float = 600.0) -> tuple[_Proc, dict]:
    return start_tandem_up(["--port", "0", "--gateway-port", "0", "--quiet", "--model", model, "--mode", mode],
                           timeout_s)


def ttft_sdk(client: Client, prompt: str, max_tokens: int) -> float:
    t0 = time.perf_counter()
    first = None
    for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - t0
    return first


def ttft_openai(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> float:
    t0 = time.perf_counter()
    first = None
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        if first is None and chunk.choices:
            first = time.perf_counter() - t0
    return first


def ttft_httpx(http: httpx.Client, model: str, prompt: str, max_tokens: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    first = None
    with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
    return first


def summary(samples: list[float]) -> dict:
    ms = sorted(s * 1000 for s in samples)
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2), "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 2),
            "mean_ms": round(statistics.fmean(ms), 2), "min_ms": round(ms[0], 2)}


def run(router: str, gateway: str, rounds: int, warmup: int, max_tokens: int) -> dict:
    paths = ("sdk", "openai", "httpx")
    samples: dict[str, list[float]] = {p: [] for p in paths}
    with Client(router, timeout=120) as sdk, \
            openai.OpenAI(base_url=gateway + "/v1", api_key="bench", max_retries=0) as oa, \
            httpx.Client(base_url=gateway, timeout=120) as http:
        model = oa.models.list().data[0].id
        calls = {
            "sdk": lambda p: ttft_sdk(sdk, p, max_tokens),
            "openai": lambda p: ttft_openai(oa, model, p, max_tokens),
            "httpx": lambda p: ttft_httpx(http, model, p, max_tokens),
        }
        for i in range(warmup + rounds):
            for k in range(len(paths)):
                path = paths[(i + k) % len(paths)]  # rotate who goes first
                t = calls[path](f"[{i}-{path}] {PROMPT}")
                if i >= warmup:
                    samples[path].append(t)
    out = {p: summary(s) for p, s in samples.items()}
    # Rounds are close in time, so per-round differences cancel most of the shared machine's drift.
    out["gateway_added_p50_ms"] = {
        path: {"p50_difference": round(out[path]["p50_ms"] - out["sdk"]["p50_ms"], 2),
               "median_paired_difference": round(1000 * statistics.median(
                   a - b for a, b in zip(samples[path], samples["sdk"], strict=True)), 2)}
        for path in ("openai", "httpx")
    }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stack_flags(p, model="smollm2-135m")
    p.add_argument("--mode", default="disagg", choices=["disagg", "colocated"])
    p.add_argument("--router", default=None, help="use this running router (with --gateway) instead of tandem up")
    p.add_argument("--gateway", default=None, help="the running gateway's URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    add_load_flags(p, max_tokens=4)
    add_out_flag(p, Path("bench/results/gateway.json"), type=Path)
    args = p.parse_args(argv)
    proc = None
    if args.router and args.gateway:
        router, gateway = args.router, args.gateway
    else:
        proc, info = start_stack(args.model, args.mode)
        router, gateway = info["router"], info["gateway"]
    try:
        result = run(router, gateway, args.rounds, args.warmup, args.max_tokens)
    finally:
        if proc is not None:
            proc.stop(30.0)
    report = {"bench": "gateway_ttft", "model": args.model, "mode": args.mode, "rounds": args.rounds,
              "max_tokens": args.max_tokens, "machine": platform.machine(), "cpus": os.cpu_count(), **result}
    write_result(args.out, report, tool="tandem.bench.gateway")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
