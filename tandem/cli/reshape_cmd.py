"""`tandem reshape 0P2D --redis-url URL`: ask a running `tandem up` for a shape, wait until it runs it.

Writes the desired shape where the planner's HostActuator does (services/planner/host.py), then
follows the launcher's state until the request is applied (prints the state as JSON, exit 0),
refused (the launcher's reason, exit 2) or overtaken by a later request, or the wait runs out (exit 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tandem.services.common.shared_flags import REDIS_URL

SUMMARY = "move a running `tandem up`'s workers to another shape (e.g. 0P2D, 1P1D) and wait until it serves so"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("shape", metavar="SHAPE", help="prefill and decode workers, e.g. 1P1D or 0P2D (the total is "
                   "the number of workers `tandem up` started)")
    REDIS_URL.add_to(p, None, "the registry of the `tandem up` to reshape (its banner's `registry` line): ")
    p.add_argument("--reason", default="tandem reshape", help="why (logged by the launcher)")
    p.add_argument("--wait-timeout", type=float, default=600.0,
                   help="seconds to wait for the shape to be applied (a decode worker drains its running streams)")


def run(args: argparse.Namespace) -> int:
    from tandem.services.planner.host import ShapeStore
    from tandem.services.planner.shape import Shape

    if not args.redis_url:
        print("error: --redis-url is needed: the registry of the `tandem up` to reshape (printed in its banner)",
              file=sys.stderr)
        return 2
    try:
        shape = Shape.parse(args.shape)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    store = ShapeStore(args.redis_url)
    try:
        return _reshape(store, shape, args.reason, args.wait_timeout)
    finally:
        store.close()


# A launcher writes its state within a poll (0.5 s) of being up, and every 2 s after.
FIRST_STATE_S = 5.0


def _reshape(store, shape, reason: str, timeout_s: float) -> int:
    deadline = time.monotonic() + FIRST_STATE_S
    while (state := store.state()) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if state is None:
        print(f"error: no `tandem up` reports a shape at {store.redis_url} (is it running, in disagg mode?)",
              file=sys.stderr)
        return 2
    slots = len(state.get("slots", []))
    if shape.workers != slots:
        print(f"error: {shape} needs {shape.workers} workers, but this deployment has {slots} worker slots: ask "
              f"for a shape with prefill + decode = {slots}", file=sys.stderr)
        return 2
    seq = store.request(shape, reason)
    deadline = time.monotonic() + timeout_s
    while True:
        state = store.state() or {}
        err = state.get("error") or {}
        if err.get("seq") == seq:
            print(f"error: {shape} refused: {err.get('message')}", file=sys.stderr)
            return 2
        if state.get("seen", 0) > seq:
            print(f"error: a later request (seq {state['seen']}) replaced this one", file=sys.stderr)
            return 1
        if state.get("seq", 0) >= seq and not state.get("busy"):
            print(json.dumps({k: v for k, v in state.items() if k != "t"}))
            return 0
        if time.monotonic() > deadline:
            print(f"error: {shape} not applied within {timeout_s:.0f}s; the launcher reports: "
                  f"{json.dumps(state)}", file=sys.stderr)
            return 1
        time.sleep(0.2)
