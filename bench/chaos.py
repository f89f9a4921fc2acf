"""Chaos drill: steady load through the HTTP gateway while processes are SIGKILLed in turn.

    python -m tandem.bench.chaos --model PATH --out bench/results/chaos.json   # starts `tandem up` itself

One `tandem up` (2 prefill + 2 decode workers by default, tcp transfers, peer liveness probes) gets
`--rate` short completion requests per second, open loop. Each phase runs `--phase-s` seconds and
SIGKILLs one process `--kill-at-s` into it: a prefill worker, a decode worker, the router, Redis,
the gateway (a baseline phase kills nothing). A second deployment injects transfer failures
(`--fault-inject transfer_fail=P`) under the same load. Per phase:

- sent / completed / failed with a clear error (an HTTP error status with a message, or a refused
  connection while the front door itself restarts) / hung (no answer within `--hang-s`: must be 0);
- pages leaked on the workers once idle (free != total, or an idle self-check failure: must be 0);
- recovery: from the kill to the start of the first request that succeeded with every later one
  of the phase succeeding too (0 when nothing failed).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.client
import json
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tandem.bench.chaos_stack import ChaosStack
from tandem.bench.flags import REQUIRED, add_load_flags, add_out_flag, add_stack_flags
from tandem.bench.results import write_result

KILLS = ("baseline", "prefill-0", "decode-0", "router", "redis", "gateway")


@dataclass
class Outcome:
    start: float
    end: float
    kind: str              # ok | error | hung
    status: int = 0        # HTTP status (0: no HTTP answer)
    message: str = ""


def one_request(host: str, port: int, body: bytes, hang_s: float) -> Outcome:
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=hang_s)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    except TimeoutError:
        return Outcome(t0, time.monotonic(), "hung", message=f"no answer within {hang_s:g}s")
    except OSError as e:  # the gateway itself is down: refused at once, which a client can act on
        return Outcome(t0, time.monotonic(), "error", message=f"{type(e).__name__}: {e}")
    finally:
        conn.close()
    end = time.monotonic()
    if resp.status == 200:
        return Outcome(t0, end, "ok", 200)
    try:
        message = json.loads(data)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = data.decode(errors="replace")[:200]
    return Outcome(t0, end, "error", resp.status, message)


def run_load(url: str, model: str, rate: float, duration_s: float, hang_s: float, max_tokens: int,
             at_kill: tuple[float, Callable[[], None]] | None = None) -> tuple[list[Outcome], float | None]:
    """Open-loop load for `duration_s`; `at_kill = (offset_s, fn)` runs fn once at that offset."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    outcomes: list[Outcome] = []
    killed_at = None
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(max_workers=max(8, int(rate * hang_s) + 4)) as pool:
        futures = []
        i = 0
        while (now := time.monotonic()) - t0 < duration_s:
            if at_kill is not None and killed_at is None and now - t0 >= at_kill[0]:
                killed_at = time.monotonic()
                at_kill[1]()
            body = json.dumps({"model": model, "prompt": f"chaos request {i}: the capital of France is",
                               "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
            futures.append(pool.submit(one_request, host, int(port), body, hang_s))
            i += 1
            time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        outcomes = [f.result() for f in futures]
    return outcomes, killed_at


def recovery_s(outcomes: list[Outcome], since: float | None) -> float | None:
    """Kill -> start of the first success after which every request of the phase succeeded."""
    if since is None:
        return None
    after = sorted((o for o in outcomes if o.start >= since - 1.0), key=lambda o: o.start)
    last_bad = max((k for k, o in enumerate(after) if o.kind != "ok"), default=None)
    if last_bad is None:
        return 0.0
    rest = after[last_bad + 1:]
    return round(rest[0].start - since, 2) if rest else None


def summarize(phase: str, outcomes: list[Outcome], killed_at: float | None, kv: dict, retries: float | None,
              back_at: float | None = None) -> dict:
    errors = [o for o in outcomes if o.kind == "error"]
    leaked = {n: (v["total"] - v["free"]) if v else None for n, v in kv.items()}
    return {
        "phase": phase, "sent": len(outcomes), "completed": sum(o.kind == "ok" for o in outcomes),
        "failed_clear": sum(1 for o in errors if o.message), "failed_unclear": sum(1 for o in errors if not o.message),
        "hung": sum(o.kind == "hung" for o in outcomes),
        "pages_leaked": sum(v for v in leaked.values() if v), "leaked_by_worker": leaked,
        "idle_check_failures": sum(v["idle_check_failures"] for v in kv.values() if v),
        "workers_unreadable": sorted(n for n, v in kv.items() if v is None),
        "recovery_s": recovery_s(outcomes, killed_at),
        "router_retries": retries,
        "restarted_in_s": round(back_at - killed_at, 2) if back_at and killed_at else None,
        "error_samples": sorted({f"{o.status} {o.message}"[:160] for o in errors})[:5],
    }


def model_id(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def drill(stack_args: list[str], phases: list[str], args: argparse.Namespace, log) -> list[dict]:
    stack = ChaosStack(stack_args)
    rows = []
    try:
        model = model_id(stack.gateway)
        for phase in phases:
            victim = None if phase in ("baseline", "transfer_fail") else phase
            kill = (args.kill_at_s, lambda v=victim: stack.kill(v)) if victim else None
            retries_before = stack.router_retries() or 0.0
            outcomes, killed_at = run_load(stack.gateway, model, args.rate, args.phase_s, args.hang_s,
                                           args.max_tokens, kill)
            if victim and not stack.wait_restarted(victim, 120):
                log(f"{victim} did not come back within 120s")
            row = summarize(phase if phase != "transfer_fail" else f"transfer_fail={args.transfer_fail:g}",
                            outcomes, killed_at, stack.wait_idle(), _delta(retries_before, stack.router_retries()),
                            stack.back_at.get(victim) if victim else None)
            rows.append(row)
            log(json.dumps({k: v for k, v in row.items() if k != "leaked_by_worker"}))
    finally:
        stack.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_stack_flags(p, model=REQUIRED, helps={"model": "model for `tandem up` (alias or local HF folder)"})
    p.add_argument("--rate", type=float, default=4.0, help="requests per second")
    p.add_argument("--phase-s", type=float, default=20.0, help="seconds of load per phase")
    p.add_argument("--kill-at-s", type=float, default=5.0, help="when, into a phase, its process is SIGKILLed")
    p.add_argument("--hang-s", type=float, default=30.0, help="a request with no answer after this long is hung")
    add_load_flags(p, max_tokens=8, helps={"max_tokens": "tokens per request"})
    p.add_argument("--phases", default=",".join(KILLS), help=f"comma separated, from {', '.join(KILLS)}")
    p.add_argument("--transfer-fail", type=float, default=0.1,
                   help="the fault-injection phase's transfer failure probability (0: skip that phase)")
    p.add_argument("--prefill", type=int, default=2, help="prefill workers")
    p.add_argument("--decode", type=int, default=2, help="decode workers")
    p.add_argument("--up-arg", action="append", default=[], help="extra `tandem up` argument (repeatable)")
    add_out_flag(p, Path("bench/results/chaos.json"), help="JSON results", type=Path)
    p.add_argument("--scenario", choices=("drill", "migration"), default="drill",
                   help="drill: the kill phases above; migration: SIGKILL a decode worker of 1P2D while --streams "
                   "streams are mid-output, and compare their text with an undisturbed run (bench/chaos_migration.py)")
    p.add_argument("--streams", type=int, default=16, help="migration: concurrent streams")
    p.add_argument("--kill-after-chunks", type=int, default=3,
                   help="migration: SIGKILL once every stream has this many chunks")
    args = p.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, flush=True)

    if args.scenario == "migration":
        return _migration(args, log)

    base = ["--model", args.model, "--prefill", str(args.prefill), "--decode", str(args.decode),
            "--transfer-backend", "tcp", "--peer-probe-interval", "0.5", "--bootstrap-timeout", "10",
            "--transfer-timeout", "10", *args.up_arg]
    load_before = _uptime()
    rows = drill(base, [x for x in args.phases.split(",") if x], args, log)
    if args.transfer_fail > 0:
        faults = ["--fault-inject", f"transfer_fail={args.transfer_fail:g},seed=1", "--enable-fault-injection"]
        rows += drill(base + faults, ["transfer_fail"], args, log)
    result = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "host": platform.node(), "uptime_before": load_before, "uptime_after": _uptime(), "phases": rows}
    write_result(args.out, result, tool="tandem.bench.chaos")
    log(f"wrote {args.out}")
    bad = [r["phase"] for r in rows if r["hung"] or r["pages_leaked"] or r["idle_check_failures"] or r["failed_unclear"]]
    if bad:
        log(f"FAILED phases (hung, leaked pages or unclear errors): {bad}")
    return 1 if bad else 0


def _migration(args: argparse.Namespace, log) -> int:
    from tandem.bench.chaos_migration import run

    load_before = _uptime()
    row = run(["--model", args.model, "--transfer-backend", "tcp", *args.up_arg], model_id, args, log)
    result = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "host": platform.node(), "uptime_before": load_before, "uptime_after": _uptime(), "migration": row}
    write_result(args.out, result, tool="tandem.bench.chaos")
    log(f"wrote {args.out}")
    ok = row["completed"] == row["identical_to_undisturbed"] == args.streams and not row["pages_leaked"]
    return 0 if ok else 1


def _delta(before: float, after: float | None) -> float | None:
    """A counter's growth; a restarted router counts from 0 again (then only its own part is seen)."""
    if after is None:
        return None
    return after - before if after >= before else after


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    raise SystemExit(main())
