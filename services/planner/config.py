"""The planner's config (`PlannerConfig`, frozen) and its flags (`PLANNER_FLAGS`, declared once).

Where it observes (`--router-metrics-url`), what it aims at (`--ttft-slo`, `--itl-slo`), which shapes
it may choose (`--planner-min/max-prefill`, `--planner-min/max-decode`), how often and how calmly it
acts (`--planner-interval`, `--planner-stable-intervals`, `--planner-cooldown`) and what it acts on
(`--planner-target host|kubernetes|metrics`). The Kubernetes target's own flags live with it
(services/planner/k8s_config.py). Torch-free; nothing here reads the environment.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from tandem.engine.config import EngineConfig
from tandem.services.common.arg_groups import DEPLOYMENT, PLANNER
from tandem.services.common.flags import Flag, Owner, add_flags
from tandem.services.common.shared_flags import HOST, METRICS_PORT, REDIS_URL
from tandem.services.planner.k8s_config import KubernetesTarget, add_k8s_arguments, k8s_target_from_args

TARGETS = ("host", "kubernetes", "metrics")
_ENGINE = EngineConfig()


@dataclass(frozen=True)
class PlannerConfig:
    ttft_slo_s: float = 2.0            # the TTFT the SLO allows, at `slo_quantile`
    itl_slo_s: float = 0.1             # the mean inter-token latency the SLO allows
    interval_s: float = 10.0           # one observation and one decision per interval
    cooldown_s: float = 60.0           # no reshape within this long of the last one
    stable_intervals: int = 3          # a better shape must win this many intervals in a row
    min_prefill: int = 0
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4
    target: str = "metrics"
    router_metrics_url: str = ""       # required: the router's /metrics (it has none unless --metrics-port)
    redis_url: str | None = None       # --planner-target host: the launcher's registry (required there)
    metrics_port: int = 0              # the planner's own /metrics (0: a free port, logged; -1: off)
    host: str = "127.0.0.1"            # where its /metrics listens
    decision_log: str = ""             # also append every decision's JSON line to this file ("": stdout only)
    k8s: KubernetesTarget = field(default_factory=KubernetesTarget)
    # How the decision is made (docs/planner.md); not flags: they describe the method, not a deployment.
    slo_quantile: float = 0.9          # the TTFT quantile the SLO is about
    headroom: float = 0.1              # feasible = predicted <= (1 - headroom) x SLO
    margin: float = 0.05               # a challenger must beat the running shape's score by this much
    correction_bounds: tuple[float, float] = (0.25, 4.0)  # measured/predicted ratio, clamped
    correction_weight: float = 0.5     # EWMA weight of a new interval's ratio
    min_samples: int = 5               # TTFT / ITL samples an interval needs to update the correction
    smoothing: tuple[float, float] = (0.5, 0.3)           # Holt's level and trend weights
    # The decode workers' mixed-chunk bounds (they shape a co-located prompt's prefill): the engine's.
    mixed_chunk_itl_factor: float = _ENGINE.mixed_chunk_itl_factor
    mixed_chunk_ttft_target_s: float = _ENGINE.mixed_chunk_ttft_target_s

    def validate(self) -> None:
        if self.ttft_slo_s <= 0 or self.itl_slo_s <= 0:
            raise ValueError("--ttft-slo and --itl-slo must be > 0 seconds")
        if self.interval_s <= 0 or self.cooldown_s < 0 or self.stable_intervals < 1:
            raise ValueError("--planner-interval must be > 0, --planner-cooldown >= 0, "
                             "--planner-stable-intervals >= 1")
        if not 0 <= self.min_prefill <= self.max_prefill:
            raise ValueError(f"need 0 <= --planner-min-prefill ({self.min_prefill}) <= --planner-max-prefill "
                             f"({self.max_prefill})")
        if not 1 <= self.min_decode <= self.max_decode:
            raise ValueError(f"need 1 <= --planner-min-decode ({self.min_decode}) <= --planner-max-decode "
                             f"({self.max_decode})")
        if not self.router_metrics_url:
            raise ValueError("--router-metrics-url is required: the router's Prometheus endpoint, e.g. "
                             "http://127.0.0.1:9464/metrics (start the router with --metrics-port)")
        if self.target not in TARGETS:
            raise ValueError(f"--planner-target must be one of {', '.join(TARGETS)}, got {self.target!r}")
        if self.target == "host" and not self.redis_url:
            raise ValueError("--planner-target host needs --redis-url: the registry of the `tandem up` it reshapes")
        if not 0 <= self.headroom < 1 or not 0 < self.slo_quantile < 1:
            raise ValueError("headroom must be in [0, 1) and slo_quantile in (0, 1)")

    @property
    def fixed_total(self) -> bool:
        """One host: the workers' number is fixed (their core slots); only their roles change."""
        return self.target == "host"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PlannerConfig:
        cfg = cls(ttft_slo_s=args.ttft_slo, itl_slo_s=args.itl_slo, interval_s=args.planner_interval,
                  cooldown_s=args.planner_cooldown, stable_intervals=args.planner_stable_intervals,
                  min_prefill=args.planner_min_prefill, max_prefill=args.planner_max_prefill,
                  min_decode=args.planner_min_decode, max_decode=args.planner_max_decode,
                  target=args.planner_target, router_metrics_url=args.router_metrics_url,
                  redis_url=args.redis_url, metrics_port=args.metrics_port, host=args.host,
                  decision_log=args.planner_decision_log,
                  k8s=k8s_target_from_args(args) if args.planner_target == "kubernetes" else KubernetesTarget())
        cfg.validate()
        return cfg


_P = Owner.PLANNER
# `tandem up --planner` forwards the SLO and planning flags it was given (up=None: to every owner);
# where the planner runs and what it reads (`--router-metrics-url`, `--redis-url`, `--metrics-port`)
# the launcher places itself, as it does for the router.
PLANNER_FLAGS = (
    Flag(("--ttft-slo",), _P, PLANNER, "seconds: the time to first token the planner keeps (at p90)",
         field="ttft_slo_s", type=float),
    Flag(("--itl-slo",), _P, PLANNER, "seconds: the mean inter-token latency the planner keeps",
         field="itl_slo_s", type=float),
    Flag(("--planner-interval",), _P, PLANNER, "seconds between observations (one decision each)",
         field="interval_s", type=float),
    Flag(("--planner-cooldown",), _P, PLANNER, "seconds after a reshape before another", field="cooldown_s",
         type=float),
    Flag(("--planner-stable-intervals",), _P, PLANNER,
         "intervals in a row a better shape must win before the planner reshapes", field="stable_intervals",
         type=int),
    Flag(("--planner-min-prefill",), _P, PLANNER, "fewest prefill workers a shape may have (0: co-located "
         "shapes allowed)", field="min_prefill", type=int),
    Flag(("--planner-max-prefill",), _P, PLANNER, "most prefill workers a shape may have", field="max_prefill",
         type=int),
    Flag(("--planner-min-decode",), _P, PLANNER, "fewest decode workers a shape may have", field="min_decode",
         type=int),
    Flag(("--planner-max-decode",), _P, PLANNER, "most decode workers a shape may have", field="max_decode",
         type=int),
    Flag(("--planner-decision-log",), _P, PLANNER, "file to append every decision to, one JSON line each "
         "(they also go to stdout)", field="decision_log"),
    Flag(("--planner-target",), _P, PLANNER, "what the planner acts on: host (tandem up's launcher, via "
         "Redis), kubernetes (the Deployments' scale) or metrics (only export the desired shape)",
         field="target", choices=TARGETS, up=Owner.NONE),   # `tandem up --planner`: its own host
    Flag(("--router-metrics-url",), _P, DEPLOYMENT, "the router's Prometheus endpoint the planner reads "
         "(required; `tandem up --planner` sets it)",
         field="router_metrics_url", up=Owner.NONE),
    HOST, REDIS_URL, METRICS_PORT,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, PLANNER_FLAGS, {Owner.PLANNER: PlannerConfig()})
    add_k8s_arguments(p)
