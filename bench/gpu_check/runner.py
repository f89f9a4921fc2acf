"""Runs the parts one after another, each in its own process group under its own timeout and the
run's total budget, and writes the run's JSON after every part (a run cut short still leaves one).

A part's outcome (`status`):
  passed    it wrote ok
  failed    it wrote an error (what did not hold), or exited non-zero
  timeout   still running at its timeout: killed with everything it started
  crashed   exited without writing a result (a segfault, an import error before the part began)
  not_run   the run's budget was spent before its turn
Everything but `passed` fails the run.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tandem.bench.results import write_result

ROOT = Path(__file__).resolve().parents[2]
MIN_PART_S = 5.0          # with less of the run's budget left than this, a part is not started
LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class Part:
    name: str
    argv: tuple[str, ...]          # the runner appends --result FILE --timeout-s N
    timeout_s: float
    what: str = ""


def link_checkout(site: Path) -> Path:
    """`site` with links to this checkout's `tandem` and `tests`, to go on the parts' PYTHONPATH: they
    import those two from the tree, and no other top-level folder of it (kernels/ would shadow an
    installed `kernels`). Returns `site`."""
    for name in ("tandem", "tests"):
        link = site / name
        if not link.exists():
            link.symlink_to(ROOT / name, target_is_directory=True)
    return site


def module_part(name: str, module: str, timeout_s: float, what: str, *args: str) -> Part:
    return Part(name, (sys.executable, "-P", "-m", module, *args), timeout_s, what)


@dataclass
class Run:
    """The run's JSON: `header` (machine, bundle) and each part's outcome, in order."""
    out: Path | None
    log: Path | None
    header: dict = field(default_factory=dict)
    parts: dict = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def failed(self) -> list[str]:
        failed = [name for name, p in self.parts.items() if not p["ok"]]
        if self.header.get("bundle", {}).get("ok") is False:
            failed.insert(0, "bundle")
        return failed

    def as_dict(self) -> dict:
        failed = self.failed()
        return {"schema": 1, "ok": not failed, "failed": failed,
                "total_s": round(time.monotonic() - self.started, 1), **self.header, "parts": self.parts}

    def write(self) -> None:
        if self.out is not None:
            write_result(self.out, self.as_dict(), tool="tandem.bench.gpu_check")   # atomic: replaces the file


def run_part(part: Part, env: dict[str, str], budget_left_s: float, log=None) -> dict:
    """Run one part; its outcome as it goes into the JSON."""
    timeout = min(part.timeout_s, budget_left_s)
    outcome = {"ok": False, "status": "not_run", "what": part.what, "seconds": 0.0,
               "timeout_s": round(timeout, 1), "exit_code": None, "error": None, "details": {}, "log_tail": []}
    if budget_left_s < MIN_PART_S:
        outcome["error"] = f"not run: {budget_left_s:.0f} s of the run's budget were left"
        return outcome
    tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
    with tempfile.TemporaryDirectory(prefix=f"gpu-check-{part.name}-") as tmp:
        result_path = Path(tmp) / "result.json"
        argv = [*part.argv, "--result", str(result_path), "--timeout-s", str(round(timeout, 1))]
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=ROOT, start_new_session=True, text=True, errors="replace")
        pump = threading.Thread(target=_pump, args=(proc.stdout, part.name, tail, log), daemon=True)
        pump.start()
        timed_out = False
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            rc = proc.wait()
        # Whatever the part started in its group goes with it (a peer process, a worker).
        _kill_group(proc.pid)
        pump.join(5.0)
        outcome["seconds"] = round(time.monotonic() - t0, 1)
        outcome["exit_code"] = rc
        result = _read(result_path)
    outcome["log_tail"] = list(tail)
    if result is not None:
        outcome["details"] = result.get("details") or {}
    if timed_out:
        outcome["status"] = "timeout"
        outcome["error"] = f"timed out after {timeout:.0f} s (killed)"
    elif result is None or result.get("ok") is None:
        outcome["status"] = "crashed"
        outcome["error"] = f"exited with code {rc} without a result" + _last_words(tail)
    elif not result["ok"] or rc != 0:
        outcome["status"] = "failed"
        outcome["error"] = result.get("error") or f"exited with code {rc}"
    else:
        outcome["status"] = "passed"
        outcome["ok"] = True
    return outcome


def run_all(parts: list[Part], env: dict[str, str], budget_s: float, run: Run) -> Run:
    """Every part in order within `budget_s` seconds (counted from `run.started`); the JSON is
    rewritten after each part."""
    log = open(run.log, "a") if run.log is not None else None
    try:
        for part in parts:
            left = budget_s - (time.monotonic() - run.started)
            print(f"gpu-check: {part.name}: {part.what} (timeout {min(part.timeout_s, max(left, 0)):.0f} s)",
                  flush=True)
            outcome = run_part(part, env, left, log)
            run.parts[part.name] = outcome
            run.write()
            verdict = outcome["status"].upper()
            print(f"gpu-check: {part.name}: {verdict} in {outcome['seconds']} s"
                  + (f": {outcome['error']}" if outcome["error"] else ""), flush=True)
    finally:
        if log is not None:
            log.close()
    return run


def summary(run: Run) -> str:
    lines = [f"{'part':<9} {'status':<8} {'seconds':>8}  error"]
    for name, p in run.parts.items():
        lines.append(f"{name:<9} {p['status']:<8} {p['seconds']:>8}  {p['error'] or ''}")
    return "\n".join(lines)


def _pump(stream, name: str, tail: collections.deque, log) -> None:
    for line in stream:
        line = line.rstrip("\n")
        tail.append(line)
        print(f"[{name}] {line}", flush=True)
        if log is not None:
            log.write(f"[{name}] {line}\n")
            log.flush()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _last_words(tail) -> str:
    lines = [line for line in tail if line.strip()][-3:]
    return (": " + " | ".join(lines)) if lines else ""
