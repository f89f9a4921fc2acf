"""What `tandem up` adds for live reshaping: the Reshaper over its worker slots (disagg mode), and the
planner process it starts with --planner."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tandem.services.launcher.config import UpConfig
from tandem.services.launcher.procs import Child, python_cmd
from tandem.services.launcher.reshape import Reshaper, Slot
from tandem.services.launcher.supervisor import Supervisor
from tandem.services.planner.host import ShapeStore


def serves_without_prefill(router_args: Sequence[str]) -> bool:
    """Whether the router was told --min-prefill-workers 0 (it then serves a shape with no prefill worker)."""
    args = list(router_args)
    value = None
    for i, a in enumerate(args):
        if a == "--min-prefill-workers" and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith("--min-prefill-workers="):
            value = a.split("=", 1)[1]
    return value is not None and value.strip() == "0"


def reshaper(cfg: UpConfig, sup: Supervisor, names: Sequence[str], cores: Sequence[tuple[int, ...] | None], url: str,
             make_worker: Callable[[str, str, tuple[int, ...] | None], Child]) -> Reshaper | None:
    """The slots `tandem up` started, each worker with its cores (None: co-located mode, no roles to move)."""
    if cfg.mode != "disagg":
        return None
    slots = [Slot(i, c, name.rsplit("-", 1)[0], name) for i, (name, c) in enumerate(zip(names, cores, strict=True))]
    return Reshaper(sup, slots, make_worker, drain_s=cfg.stop_grace_s,
                    allow_no_prefill=serves_without_prefill(cfg.router_args), store=ShapeStore(url))


def planner_argv(cfg: UpConfig, url: str, router_metrics_port: int) -> list[str]:
    """`tandem planner` acting on this launcher (through Redis), reading the router's /metrics."""
    host = "127.0.0.1" if cfg.host in ("", "0.0.0.0", "::") else cfg.host
    host = f"[{host}]" if ":" in host else host
    return ["planner", *cfg.planner_args, "--planner-target", "host", "--redis-url", url,
            "--router-metrics-url", f"http://{host}:{router_metrics_port}/metrics"]


def start_planner(cfg: UpConfig, url: str, router_metrics_port: int, env: dict[str, str],
                  on_line: Callable[[str, str], None]) -> Child:
    """A started planner process (also the Supervisor's restart of it)."""
    child = Child("planner", python_cmd(*planner_argv(cfg, url, router_metrics_port)), env=env, on_line=on_line)
    child.start()
    return child
