"""A deployment under measurement: what a benchmark starts (`Deployment`), what it talks to
(`Endpoint`), and `measure_deployment`, the start → run → stop every harness shares (the sweep,
the KV-tiers comparison, the structured-output hand-off). Torch-free."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)


class DeploymentUnavailable(RuntimeError):
    """The deployment cannot run on this machine (the message says why)."""



@dataclass(frozen=True)
class Endpoint:
    backend: str                         # a bench.serve.backends registry name
    base_url: str
    model: str = ""
    force_output_len: str = "ignore-eos"


class Deployment(Protocol):
    name: str

    def start(self) -> Endpoint: ...

    def close(self) -> None: ...

    def describe(self) -> str: ...

    def log_tail(self) -> str: ...


def measure_deployment(dep: Deployment, run: Callable[[Endpoint], dict],
                       echo=print) -> tuple[dict | None, str]:
    """Start `dep`, `run(endpoint)` against it, stop it. Returns (its results entry: what `run` returned
    plus the command, backend and load averages, "") or (None, why it was skipped or failed): one broken
    deployment must not lose the others' results. Ctrl-C / SIGTERM still stop it and propagate."""
    load_before = _load_avg()  # the cores may be shared: say how busy the machine was
    echo(f"--- {dep.name}: starting `{dep.describe()}` (load average {load_before})")
    t0 = time.monotonic()
    try:
        ep = dep.start()
    except DeploymentUnavailable as e:
        echo(f"--- {dep.name}: skipped: {e}")
        dep.close()
        return None, str(e)
    except BaseException:  # Ctrl-C or SIGTERM while it starts: stop what was started
        dep.close()
        raise
    try:
        echo(f"--- {dep.name}: up in {time.monotonic() - t0:.0f} s ({ep.backend} {ep.base_url})")
        entry = {"command": dep.describe(), "backend": ep.backend, "load_avg_before": load_before}
        entry.update(run(ep))
        entry["load_avg_after"] = _load_avg()
        return entry, ""
    except Exception as e:
        log.exception("%s failed; its last output:\n%s", dep.name, dep.log_tail())
        return None, f"{type(e).__name__}: {e}\n{dep.log_tail()}"
    finally:
        dep.close()


def _load_avg() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
