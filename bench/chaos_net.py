"""Network chaos drill: steady load on a deployment whose every service runs on a host of its own
(network namespaces, tandem.bench.cluster), while links are cut, healed and slowed. Needs root.

    python -m tandem.bench.chaos_net --out bench/results/chaos_net.json

Scenarios (each a phase of `--phase-s` seconds of open-loop load through the gateway; the event
happens `--event-at-s` into it):

- `baseline`: nothing happens (2P2D).
- `decode_isolated`: a decode host is taken off the network (from the router, Redis and the prefill
  hosts alike) and put back `--heal-after-s` later: its streams must continue on the other decode
  worker, and it must serve again after healing, without a restart.
- `prefill_cut`: a prefill host cut and healed the same way.
- `pd_cut`: one prefill and one decode host cut off each other only (both still reach the router and
  Redis), during transfers, and mended `--heal-after-s` later: their pairings must fail over to the
  other hosts, nothing hangs until the mend.
- `redis_partitioned`: the Redis host cut off for `--redis-outage-s` (30 s): the router keeps routing
  from what it knew, the workers' heartbeats fail and come back.
- `slow_link`: every prefill host's link shaped to `--slow-mbit` (100 Mbit/s) and ~2,000-token
  prompts: slow must not be mistaken for dead.
- `only_prefill_killed`: a 1P1D deployment whose only prefill worker is SIGKILLed (nobody restarts it
  here): the decode worker prefills instead (decode-only fallback).
- `corrupt`: a 1P1D deployment whose prefill worker corrupts one byte of a room's KV in flight with
  probability `--corrupt` (`--fault-inject kv_corrupt=P`): every corrupted room must be caught by the
  decode side's checksum before it decodes (0 wrong), and the request served another way.

Not emulated: packet delay and loss (this kernel has no `netem`). A P-D cut is a blackhole route on
each side: open connections go silent, but a new connect fails at once instead of timing out.

Per phase: sent / ok / failed (clear error) / hung (no answer within `--hang-s`) / wrong (a greedy
fp32 answer that differs from the same prompt's answer on the undisturbed deployment), recovery
(event -> the first success after which every request of the phase succeeded), pages leaked on the
workers once idle, and afterwards: namespaces and links left behind (must be none).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.client
import json
import math
import re
import threading
import time
import urllib.request
from pathlib import Path

from tandem.bench.chaos import recovery_s
from tandem.bench.cluster.deploy import Cluster
from tandem.bench.cluster.net import Network, links, namespaces
from tandem.bench.flags import add_load_flags, add_out_flag
from tandem.bench.results import write_result

SCENARIOS = ("baseline", "decode_isolated", "prefill_cut", "pd_cut", "redis_partitioned", "slow_link",
             "only_prefill_killed", "corrupt")
WORKER_ARGS = ("--dtype", "float32", "--kv-cache-gb", "0.5", "--transfer-backend", "auto")
# The default router: prompts of up to 1,024 tokens may prefill on their decode worker when that is sooner.
# The drill's short prompts go to prefill workers (-1), so that cutting one matters.
ROUTER_ARGS = ("--local-prefill-max-tokens", "-1")


def prompts(long: bool) -> list[str]:
    """8 prompts: short ones, or ~2,000-token ones (each a different document, so nothing is cached)."""
    if not long:
        return [f"Chaos request {i}: the capital of France is" for i in range(8)]
    words = "the river carries sand from the mountains to the sea and the sea keeps it".split()
    return [f"Document {i}. " + " ".join(words[(i + k) % len(words)] for k in range(1500)) + "\nSummary:"
            for i in range(8)]


def ask(url: str, prompt: str, max_tokens: int, hang_s: float) -> dict:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(host, int(port), timeout=hang_s)
    try:
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        conn.request("POST", "/v1/completions", body.encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    except TimeoutError:
        return {"start": t0, "end": time.monotonic(), "kind": "hung", "message": f"no answer within {hang_s:g}s"}
    except OSError as e:
        return {"start": t0, "end": time.monotonic(), "kind": "error", "message": f"{type(e).__name__}: {e}"}
    finally:
        conn.close()
    out = {"start": t0, "end": time.monotonic(), "status": resp.status}
    try:
        payload = json.loads(data)
    except ValueError:
        return {**out, "kind": "error", "message": data.decode(errors="replace")[:200]}
    if resp.status == 200:
        return {**out, "kind": "ok", "text": payload["choices"][0]["text"]}
    return {**out, "kind": "error", "message": str(payload.get("error", {}).get("message", payload))[:200]}


class _Result:
    """Outcome-like view for chaos.recovery_s."""

    def __init__(self, r: dict):
        self.start, self.kind = r["start"], r["kind"] if r["kind"] != "ok" or not r.get("wrong") else "wrong"


def run_load(url: str, texts: list[str], reference: dict[str, str] | None, rate: float, duration_s: float,
             hang_s: float, max_tokens: int, events: list[tuple[float, callable]]) -> tuple[list[dict], float | None]:
    """Open-loop load; `events`: (offset_s, fn) run once each at their offset. Returns the results
    (each marked wrong if its text differs from `reference`) and when the first event ran."""
    t0 = time.monotonic()
    pending = sorted(events, key=lambda e: e[0])
    first_event = None
    results = []
    with cf.ThreadPoolExecutor(max_workers=max(8, int(rate * hang_s) + 4)) as pool:
        futures, i = [], 0
        while (now := time.monotonic()) - t0 < duration_s:
            while pending and now - t0 >= pending[0][0]:
                first_event = first_event or time.monotonic()
                threading.Thread(target=pending.pop(0)[1], daemon=True).start()
            prompt = texts[i % len(texts)]
            futures.append((prompt, pool.submit(ask, url, prompt, max_tokens, hang_s)))
            i += 1
            time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        for prompt, f in futures:
            r = {**f.result(), "prompt": prompt}
            if r["kind"] == "ok" and reference is not None:
                r["wrong"] = r["text"] != reference[prompt]
            results.append(r)
    return results, first_event


def pages(c: Cluster, timeout_s: float = 30.0) -> dict[str, dict | None]:
    """Per worker, once idle (or at the timeout): free and total pages (None: /metrics unreachable)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = {}
        for name in c.worker_names():
            if not c.children[name].alive:
                out[name] = None
                continue
            try:
                text = urllib.request.urlopen(c.worker_metrics_url(name), timeout=5).read().decode()
            except OSError:
                out[name] = None
                continue
            out[name] = {k: _sample(text, f'tandem_kv_pages{{state="{k}"}}') for k in ("free", "total")}
        if all(v is None or v["free"] == v["total"] for v in out.values()) or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


def _sample(text: str, name: str) -> float:
    m = re.search("^" + re.escape(name) + r" (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def counter(url: str, name: str) -> float:
    """The sum of a metric's samples, every label set, at a /metrics URL (NaN: unreachable)."""
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return float("nan")
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def router_counter(c: Cluster, name: str) -> float:
    return counter(c.router_metrics_url(), name)


def transfer_ms(c: Cluster) -> tuple[float, float]:
    """The decode workers' KV transfer time so far: (sum in ms, rooms)."""
    total, rooms = 0.0, 0.0
    for name in c.worker_names("decode"):
        try:
            text = urllib.request.urlopen(c.worker_metrics_url(name), timeout=5).read().decode()
        except OSError:
            continue
        total += _sample(text, "kv_transfer_latency_ms_sum")
        rooms += _sample(text, "kv_transfer_latency_ms_count")
    return total, rooms


def summarize(phase: str, results: list[dict], event_at: float | None, kv: dict, extra: dict) -> dict:
    ok = [r for r in results if r["kind"] == "ok"]
    errors = [r for r in results if r["kind"] == "error"]
    return {
        "phase": phase, "sent": len(results), "ok": sum(not r.get("wrong") for r in ok),
        "wrong": sum(bool(r.get("wrong")) for r in ok), "failed": len(errors),
        "hung": sum(r["kind"] == "hung" for r in results),
        "recovery_s": recovery_s([_Result(r) for r in results], event_at),
        "pages_leaked": sum(v["total"] - v["free"] for v in kv.values() if v),
        "workers_unreadable": sorted(n for n, v in kv.items() if v is None),
        "latency_p50_s": _pct([r["end"] - r["start"] for r in ok], 50),
        "latency_max_s": _pct([r["end"] - r["start"] for r in ok], 100),
        "error_samples": sorted({r["message"][:160] for r in errors})[:4],
        **extra,
    }


def _pct(xs: list[float], q: int) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(len(xs) * q / 100))], 2)


def reference_answers(c: Cluster, texts: list[str], max_tokens: int) -> dict[str, str]:
    """Each prompt alone on the undisturbed deployment (greedy fp32: the answer, whatever the batch)."""
    out = {}
    for t in texts:
        r = ask(c.gateway_url, t, max_tokens, 300)
        if r["kind"] != "ok":
            raise RuntimeError(f"the undisturbed deployment failed a request: {r}")
        out[t] = r["text"]
    return out


def drill_2p2d(args: argparse.Namespace, phases: list[str], log, log_dir: Path | None) -> list[dict]:
    rows = []
    with Network("chaos") as net, Cluster(net, prefill=2, decode=2, worker_args=WORKER_ARGS, router_args=ROUTER_ARGS,
                                          log_dir=log_dir) as c:
        short = prompts(long=False)
        ref_short = reference_answers(c, short, args.max_tokens)
        for phase in phases:
            texts, ref, rate, dur = short, ref_short, args.rate, args.phase_s
            events: list[tuple[float, callable]] = []
            extra: dict = {}
            if phase == "decode_isolated":
                events = [(args.event_at_s, lambda: net.partition("decode-0")),
                          (args.event_at_s + args.heal_after_s, lambda: net.heal("decode-0"))]
            elif phase == "prefill_cut":
                events = [(args.event_at_s, lambda: net.partition("prefill-0")),
                          (args.event_at_s + args.heal_after_s, lambda: net.heal("prefill-0"))]
            elif phase == "pd_cut":
                events = [(args.event_at_s, lambda: net.cut("prefill-0", "decode-0")),
                          (args.event_at_s + args.heal_after_s, lambda: net.mend("prefill-0", "decode-0"))]
            elif phase == "redis_partitioned":
                dur = max(dur, args.event_at_s + args.redis_outage_s + 10)
                events = [(args.event_at_s, lambda: net.partition("redis")),
                          (args.event_at_s + args.redis_outage_s, lambda: net.heal("redis"))]
            elif phase == "slow_link":
                # Their reference answers come after the phase: asked first, they would be cached on
                # both sides, and the load would move no KV over the slow link.
                texts, ref = prompts(long=True), None
                rate = args.slow_rate
                for w in c.worker_names("prefill"):
                    net.shape(w, args.slow_mbit)
                extra["link_mbit"] = args.slow_mbit
            transfers_before = transfer_ms(c)
            migrations_before = router_counter(c, "tandem_router_migrations_total")
            retries_before = router_counter(c, "tandem_router_retries_total")
            results, event_at = run_load(c.gateway_url, texts, ref, rate, dur, args.hang_s, args.max_tokens, events)
            if phase == "slow_link":
                for w in c.worker_names("prefill"):
                    net.shape(w, None)
                ref = reference_answers(c, texts, args.max_tokens)
                for r in results:
                    if r["kind"] == "ok":
                        r["wrong"] = r["text"] != ref[r["prompt"]]
            ms, rooms = (a - b for a, b in zip(transfer_ms(c), transfers_before, strict=True))
            extra["kv_transfer_mean_ms"] = round(ms / rooms, 1) if rooms else None
            extra["router_migrations"] = router_counter(c, "tandem_router_migrations_total") - migrations_before
            extra["router_retries"] = router_counter(c, "tandem_router_retries_total") - retries_before
            if phase in ("decode_isolated", "prefill_cut"):
                victim = "decode-0" if phase == "decode_isolated" else "prefill-0"
                extra["readmitted_s"] = readmitted(c, victim, short, args)
            rows.append(summarize(phase, results, event_at, pages(c), extra))
            log(json.dumps(rows[-1]))
    rows[-1]["left_behind"] = net.leftovers()
    return rows


def readmitted(c: Cluster, name: str, texts: list[str], args: argparse.Namespace) -> float | None:
    """Seconds until a healed worker served a request again (None: not within 60 s)."""
    metric = "tandem_worker_requests_total"
    t0 = time.monotonic()
    before = None
    while time.monotonic() - t0 < 60:
        now = worker_counter(c, name, metric)
        if not math.isnan(now):              # its /metrics answered
            if before is None:
                before = now
            elif now > before:
                return round(time.monotonic() - t0, 1)
        for t in texts[:4]:
            ask(c.gateway_url, t, 2, 30)
    return None


def drill_1p1d_prefill_killed(args: argparse.Namespace, log, log_dir: Path | None) -> dict:
    with Network("chaos1") as net, Cluster(net, prefill=1, decode=1, worker_args=WORKER_ARGS,
                                           router_args=ROUTER_ARGS, log_dir=log_dir) as c:
        texts = prompts(long=False)
        ref = reference_answers(c, texts, args.max_tokens)
        fallbacks_before = router_counter(c, "tandem_router_fallbacks_total")
        results, event_at = run_load(c.gateway_url, texts, ref, args.rate, args.phase_s, args.hang_s, args.max_tokens,
                                     [(args.event_at_s, lambda: c.kill("prefill-0"))])
        row = summarize("only_prefill_killed", results, event_at, pages(c),
                        {"router_fallbacks": router_counter(c, "tandem_router_fallbacks_total") - fallbacks_before})
        log(json.dumps(row))
    row["left_behind"] = net.leftovers()
    return row


def drill_1p1d_corrupt(args: argparse.Namespace, log, log_dir: Path | None) -> dict:
    faults = ("--enable-fault-injection", "--fault-inject", f"kv_corrupt={args.corrupt:g},seed=1")
    with Network("chaos2") as net, Cluster(net, prefill=1, decode=1, worker_args=(*WORKER_ARGS, *faults),
                                           router_args=ROUTER_ARGS, log_dir=log_dir) as c:
        texts = [f"Integrity request {i}: the largest planet is" for i in range(8)]
        results, _ = run_load(c.gateway_url, texts, None, args.rate, args.phase_s, args.hang_s, args.max_tokens, [])
        counters = {"integrity_failures_caught": worker_counter(c, "decode-0", "tandem_kv_integrity_failures_total"),
                    "router_retries": router_counter(c, "tandem_router_retries_total"),
                    "router_fallbacks": router_counter(c, "tandem_router_fallbacks_total")}
        # The references last, on the same deployment: greedy fp32 is the same answer whatever the path
        # (a request whose KV was caught corrupt is served by the decode worker's own prefill).
        ref = reference_answers(c, texts, args.max_tokens)
        for r in results:
            if r["kind"] == "ok":
                r["wrong"] = r["text"] != ref[r["prompt"]]
        row = summarize("corrupt", results, None, pages(c),
                        {"kv_corrupt": args.corrupt, **counters})
        log(json.dumps(row))
    row["left_behind"] = net.leftovers()
    return row


def worker_counter(c: Cluster, name: str, metric: str) -> float:
    return counter(c.worker_metrics_url(name), metric)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.chaos_net", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma separated, from {', '.join(SCENARIOS)}")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (short prompts)")
    p.add_argument("--slow-rate", type=float, default=0.3, help="slow_link: requests per second (~2,000-token prompts)")
    p.add_argument("--phase-s", type=float, default=30.0, help="seconds of load per phase")
    p.add_argument("--event-at-s", type=float, default=5.0, help="when, into a phase, its event happens")
    p.add_argument("--heal-after-s", type=float, default=15.0, help="a cut host is healed this long after the cut")
    p.add_argument("--redis-outage-s", type=float, default=30.0, help="redis_partitioned: how long Redis is cut off")
    p.add_argument("--slow-mbit", type=float, default=100.0, help="slow_link: every prefill host's link rate")
    p.add_argument("--hang-s", type=float, default=90.0, help="a request with no answer after this long is hung")
    add_load_flags(p, max_tokens=16, helps={"max_tokens": "tokens per request"})
    p.add_argument("--corrupt", type=float, default=0.2, help="corrupt: probability a room's KV is corrupted")
    p.add_argument("--log-dir", type=Path, default=None, help="keep every process's output here")
    add_out_flag(p, Path("bench/results/chaos_net.json"), help="JSON results", type=Path)
    args = p.parse_args(argv)
    chosen = [s for s in args.scenarios.split(",") if s]
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenarios: {', '.join(sorted(unknown))}")

    def log(msg: str) -> None:
        print(msg, flush=True)

    rows = []
    two = [s for s in chosen if s not in ("only_prefill_killed", "corrupt")]
    if two:
        rows += drill_2p2d(args, two, log, args.log_dir)
    if "only_prefill_killed" in chosen:
        rows.append(drill_1p1d_prefill_killed(args, log, args.log_dir))
    if "corrupt" in chosen:
        rows.append(drill_1p1d_corrupt(args, log, args.log_dir))
    left = namespaces("tdm-chaos") + links("tdm-chaos")
    result = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "phases": rows, "left_behind": left}
    write_result(args.out, result, tool="tandem.bench.chaos_net")
    log(f"wrote {args.out}")
    bad = [r["phase"] for r in rows if r["hung"] or r["wrong"] or r["pages_leaked"]]
    if bad or left:
        log(f"FAILED: phases with hung, wrong or leaked: {bad}; left behind: {left}")
    return 1 if bad or left else 0


if __name__ == "__main__":
    raise SystemExit(main())
