"""What a part process and the run share: the result file a part writes, and how a part fails.

A part is `python -m bench.gpu_check.part_X --result FILE --timeout-s N`. It fills `Report.details`
as it goes and saves them after each step, so a part that is killed at its timeout still leaves what
it measured; at the end `part_main` writes `ok` and, on failure, the error that says what failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path


class CheckFailed(Exception):
    """Something that must hold on a GPU machine did not: the message says what."""


def require(cond: bool, message: str) -> None:
    if not cond:
        raise CheckFailed(message)


class Report:
    def __init__(self, path: Path | None, timeout_s: float):
        self.path = path
        self.details: dict = {}
        self.deadline = time.monotonic() + timeout_s

    def left_s(self) -> float:
        """Seconds until the run kills this part."""
        return self.deadline - time.monotonic()

    def save(self, ok: bool | None = None, error: str | None = None) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"ok": ok, "error": error, "details": self.details}, indent=1, default=str))
        tmp.replace(self.path)


def part_main(run: Callable[[Report, argparse.Namespace], None], add_args: Callable | None = None,
              argv: list[str] | None = None) -> int:
    """Run one part: `run(report, args)` returns normally (passed) or raises (failed)."""
    p = argparse.ArgumentParser()
    p.add_argument("--result", type=Path, default=None, help="where to write the part's JSON result")
    p.add_argument("--timeout-s", type=float, default=600.0, help="when the run will kill this part")
    if add_args is not None:
        add_args(p)
    args = p.parse_args(argv)
    report = Report(args.result, args.timeout_s)
    report.save()
    try:
        run(report, args)
    except Exception as e:
        traceback.print_exc()
        error = str(e) if isinstance(e, CheckFailed) else f"{type(e).__name__}: {e}"
        report.save(ok=False, error=error)
        print(f"FAILED: {error}", flush=True)
        return 1
    report.save(ok=True)
    return 0


def main_of(run: Callable[[Report, argparse.Namespace], None], add_args: Callable | None = None) -> None:
    sys.exit(part_main(run, add_args))
