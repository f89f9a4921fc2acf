"""Chaos drill, mid-stream migration scenario: SIGKILL a decode worker while streams are mid-output.

    python -m tandem.bench.chaos --scenario migration --model PATH --streams 16 --out bench/results/chaos_migration.json

One `tandem up` with 1 prefill + 2 decode workers. Each of `--streams` prompts is first completed
once, undisturbed (greedy, non-streaming, through the gateway); then all are sent again at once as
streams (`stream: true`), and once every stream has `--kill-after-chunks` chunks, `decode-0` is
SIGKILLed. Reported: streams completed, streams whose text equals the undisturbed run, the router's
migrations by outcome, and the pages each worker holds once idle. Exit status non-zero unless every
stream completed with identical text and nothing leaked.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.client
import json
import threading
import time

from tandem.bench.chaos_stack import ChaosStack

OUTCOMES = ("migrated", "exhausted", "no_worker", "unsupported", "deadline")


def _post(url: str, body: dict, timeout_s: float) -> http.client.HTTPResponse:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return conn.getresponse()


def complete(url: str, body: dict, timeout_s: float) -> str:
    resp = _post(url, body, timeout_s)
    data = json.loads(resp.read())
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {data}")
    return data["choices"][0]["text"]


def stream(url: str, body: dict, timeout_s: float, on_chunk) -> tuple[str, str]:
    """The streamed text and how the stream ended ("ok", or the error it carried)."""
    resp = _post(url, {**body, "stream": True}, timeout_s)
    if resp.status != 200:
        return "", f"HTTP {resp.status}: {resp.read()[:200]!r}"
    text, ended = [], "no [DONE]"
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            ended = "ok"
            break
        event = json.loads(line[6:])
        if "error" in event:
            return "".join(text), f"error: {event['error']}"
        text.append(event["choices"][0]["text"])
        on_chunk()
    return "".join(text), ended


def run(stack_args: list[str], model_id, args: argparse.Namespace, log) -> dict:
    stack = ChaosStack(["--prefill", "1", "--decode", "2", *stack_args])
    try:
        model = model_id(stack.gateway)
        bodies = [{"model": model, "prompt": f"Migration drill {i}: write a long story about the number {i}.",
                   "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True} for i in range(args.streams)]
        with cf.ThreadPoolExecutor(args.streams) as pool:
            want = list(pool.map(lambda b: complete(stack.gateway, b, args.hang_s), bodies))
        before = {o: stack.router_metric(f'tandem_router_migrations_total{{outcome="{o}"}}') or 0.0 for o in OUTCOMES}
        chunks = [0] * args.streams
        lock = threading.Lock()

        def seen(i: int) -> None:
            with lock:
                chunks[i] += 1

        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(args.streams) as pool:
            futures = [pool.submit(stream, stack.gateway, b, args.hang_s, lambda i=i: seen(i))
                       for i, b in enumerate(bodies)]
            while min(chunks) < args.kill_after_chunks and not all(f.done() for f in futures):
                time.sleep(0.005)
            at_kill = list(chunks)
            stack.kill("decode-0")
            killed_at = time.monotonic() - t0
            got = [f.result() for f in futures]
        after = {o: stack.router_metric(f'tandem_router_migrations_total{{outcome="{o}"}}') or 0.0 for o in OUTCOMES}
        kv = stack.wait_idle()
        row = {
            "scenario": "decode-0 SIGKILLed mid-stream, 1P2D", "streams": args.streams,
            "max_tokens": args.max_tokens, "killed_at_s": round(killed_at, 2),
            "chunks_at_kill_min": min(at_kill), "chunks_at_kill_max": max(at_kill),
            "mid_output_at_kill": sum(0 < c < args.max_tokens for c in at_kill),
            "completed": sum(end == "ok" for _, end in got),
            "identical_to_undisturbed": sum(end == "ok" and text == w for (text, end), w in zip(got, want, strict=True)),
            "migrations": {o: after[o] - before[o] for o in OUTCOMES},
            "pages_leaked": sum((v["total"] - v["free"]) for n, v in kv.items() if v and n != "decode-0"),
            "errors": sorted({end for _, end in got if end != "ok"})[:5],
        }
        log(json.dumps(row))
        return row
    finally:
        stack.close()
