"""What a live reshape costs on one host: a worker's drain and its restart in the other role.

    python -m tandem.bench.reshape_cost --out bench/results/reshape_cost.json [--model PATH] [--repeats 3]

Starts one idle `tandem up --prefill 1 --decode 1 --min-prefill-workers 0` (default model: SmolLM2,
so the kernel cache is warm after the first start) and moves it 1P1D -> 0P2D -> 1P1D `--repeats`
times through the launcher's Redis keys (services/planner/host.py), as `tandem reshape` does. Per
move: the request-to-applied wall time, the drain (SIGTERM to exit), the start (exit to READY: a new
process, imports, model load, KV pool, warm-up), and the new worker's own `startup_s` (its READY
line: everything after the imports), so the part an in-place role switch could save is visible.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from tandem.bench.flags import add_out_flag, add_stack_flags
from tandem.bench.results import write_result
from tandem.services.planner.host import ShapeStore
from tandem.services.planner.shape import Shape

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"^\[([\w-]+)\] TANDEM_READY (\{.*\})$")


def _move(store: ShapeStore, shape: Shape, timeout_s: float) -> tuple[float, dict]:
    t0 = time.monotonic()
    seq = store.request(shape, "tandem.bench.reshape_cost")
    while True:
        state = store.state() or {}
        if (state.get("error") or {}).get("seq") == seq:
            raise RuntimeError(state["error"]["message"])
        if state.get("seq", 0) >= seq and not state.get("busy"):
            return time.monotonic() - t0, state
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"{shape} not applied in {timeout_s:.0f}s: {state}")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stack_flags(ap, model=None, helps={"model": "model path (default: tandem's default, SmolLM2-135M)"})
    ap.add_argument("--repeats", type=int, default=3, help="1P1D -> 0P2D -> 1P1D round trips")
    add_out_flag(ap, "bench/results/reshape_cost.json")
    args = ap.parse_args(argv)

    cmd = [sys.executable, "-P", "-m", "tandem.cli", "up", "--port", "0", "--gateway-port", "-1", "--quiet", "--ready-json",
           "--prefill", "1", "--decode", "1", "--min-prefill-workers", "0",
           *(["--model", args.model] if args.model else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True)
    info: dict = {}
    ready: dict[str, dict] = {}
    up = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            line = line.rstrip()
            if line.startswith("TANDEM_UP "):
                info.update(json.loads(line[len("TANDEM_UP "):]))
                up.set()
            elif (m := READY.match(line)) is not None:
                ready[m.group(1)] = json.loads(m.group(2))
        up.set()

    threading.Thread(target=pump, daemon=True).start()
    moves = []
    try:
        if not up.wait(900) or not info:
            raise RuntimeError("tandem up did not come up")
        store = ShapeStore(info["redis_url"])
        first = {w["worker_id"].rsplit("-", 1)[0]: w["startup_s"] for w in info["workers"]}
        for i in range(args.repeats):
            for shape in (Shape(0, 2), Shape(1, 1)):
                wall, state = _move(store, shape, 600)
                move = state["last_move"]
                new = ready.get(move["to"], {})
                moves.append({"round": i, "to_shape": str(shape), "wall_s": round(wall, 2), **move,
                              "role": new.get("role"), "startup_s": new.get("startup_s"),
                              "process_s": round(move["start_s"] - new["startup_s"], 2) if new else None})
                print(json.dumps(moves[-1]), flush=True)
        store.close()
    finally:
        proc.terminate()
        proc.wait(60)
    warm = moves[1:] if len(moves) > 1 else moves    # the first new worker may still fill the kernel cache

    def median(key: str) -> float:
        return round(statistics.median(m[key] for m in warm), 2)

    report = {"bench": "reshape_cost", "model": args.model or "default (SmolLM2-135M-Instruct)",
              "machine": platform.machine(), "python": platform.python_version(), "first_startup_s": first,
              "moves": moves, "median_warm": {k: median(k) for k in ("wall_s", "drain_s", "start_s", "startup_s",
                                                                      "process_s")}}
    write_result(args.out, report, tool="tandem.bench.reshape_cost")
    print(json.dumps(report["median_warm"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
