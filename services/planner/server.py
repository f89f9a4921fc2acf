"""The planner process: every interval observe → predict → decide → log → export → act.

Each decision is printed as one JSON line (`Decision.to_json()`: the observed and predicted load, the
step costs and corrections it used, every candidate's predicted TTFT/ITL and headroom; also appended
to `--planner-decision-log` when given) and exported
on the planner's /metrics: `tandem_planner_desired_workers{role}`, `tandem_planner_current_workers{role}`,
`tandem_planner_predicted_ttft_seconds` / `_itl_seconds` (of the desired shape),
`tandem_planner_predicted_arrival_rate`, `tandem_planner_decisions_total{action}`. A reshape goes to
the actuator (`--planner-target`: host → the launcher via Redis, kubernetes → the Deployments' scale,
metrics → nobody: an HPA/KEDA may act on the desired workers). SIGTERM/SIGINT stop the loop at once.
Lifecycle: create → `start()` (metrics endpoint) → `run(stop)` → `close()` (safe twice). Torch-free.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import sys
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from tandem.services.planner.config import PlannerConfig
from tandem.services.planner.decide import Planner
from tandem.services.planner.observe import RouterObserver
from tandem.services.planner.shape import Actuator, Decision

log = logging.getLogger(__name__)


def make_actuator(cfg: PlannerConfig) -> Actuator | None:
    """The `--planner-target`'s actuator, imported only when asked for (kubernetes needs its client)."""
    if cfg.target == "host":
        from tandem.services.planner.host import HostActuator

        return HostActuator(cfg.redis_url)
    if cfg.target == "kubernetes":
        from tandem.services.planner.k8s import KubernetesActuator

        return KubernetesActuator.from_config(cfg)
    return None


class PlannerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.desired = Gauge("tandem_planner_desired_workers", "Workers the planner wants, by role", ["role"],
                             registry=r)
        self.current = Gauge("tandem_planner_current_workers", "Workers running, by role", ["role"], registry=r)
        self.ttft = Gauge("tandem_planner_predicted_ttft_seconds", "Predicted TTFT (the SLO's quantile) of the "
                          "desired shape next interval (+Inf: it cannot keep up)", registry=r)
        self.itl = Gauge("tandem_planner_predicted_itl_seconds", "Predicted mean inter-token latency of the "
                         "desired shape next interval", registry=r)
        self.rate = Gauge("tandem_planner_predicted_arrival_rate", "Forecast requests/s of the next interval",
                          registry=r)
        self.decisions = Counter("tandem_planner_decisions", "Decisions by action (keep, hold, reshape)",
                                 ["action"], registry=r)
        self.correction = Gauge("tandem_planner_correction", "Measured / predicted of the running shape (each shape learns its "
                                "own while it runs; one never run borrows the running shape's)", ["kind"], registry=r)

    def export(self, d: Decision, planner: Planner) -> None:
        self.decisions.labels(d.action).inc()
        if d.current is None:
            return
        for role, shape, gauge in (("prefill", d.desired, self.desired), ("decode", d.desired, self.desired),
                                   ("prefill", d.current, self.current), ("decode", d.current, self.current)):
            gauge.labels(role).set(getattr(shape, role))
        score = d.scores.get(str(d.desired))
        if score is not None:
            self.ttft.set(math.inf if score["ttft"] is None else score["ttft"])
            self.itl.set(math.inf if score["itl"] is None else score["itl"])
        if planner.last_load is not None:
            self.rate.set(planner.last_load.rate)
        ttft, itl = planner.correction(d.current, d.current)
        self.correction.labels("ttft").set(ttft.value)
        self.correction.labels("itl").set(itl.value)


class PlannerService:
    def __init__(self, cfg: PlannerConfig, actuator: Actuator | None, observer: RouterObserver | None = None,
                 out=None):
        self.cfg = cfg
        self.actuator = actuator
        self.observer = observer or RouterObserver(cfg.router_metrics_url)
        self.planner = Planner(cfg, actuator)
        self.metrics = PlannerMetrics()
        self.out = out or sys.stdout
        self.metrics_port: int | None = None
        self._httpd = None

    def start(self) -> None:
        if self.cfg.metrics_port >= 0:
            self._httpd, _ = start_http_server(self.cfg.metrics_port, addr=self.cfg.host,
                                               registry=self.metrics.registry)
            self.metrics_port = self._httpd.server_port

    def step(self) -> Decision | None:
        """One interval; None when the router could not be read (or this was the first scrape)."""
        obs = self.observer.observe()
        if obs is None:
            if self.observer.error:
                log.warning("cannot read the router's metrics at %s: %s", self.cfg.router_metrics_url,
                            self.observer.error)
            return None
        decision = self.planner.step(obs)
        line = json.dumps({"planner": decision.to_json()}, default=str)
        print(line, file=self.out, flush=True)
        if self.cfg.decision_log:
            with open(self.cfg.decision_log, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        self.metrics.export(decision, self.planner)
        if decision.action == "reshape" and self.actuator is not None:
            log.info("reshaping %s -> %s: %s", decision.current, decision.desired, decision.reason)
            self.actuator.apply(decision.desired, decision.reason)
        return decision

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.step()
            except Exception:   # an actuator's or the router's trouble: logged, retried next interval
                log.exception("planner step failed")
            stop.wait(self.cfg.interval_s)

    def close(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        actuator, self.actuator = self.actuator, None
        if actuator is not None and hasattr(actuator, "close"):
            actuator.close()


def serve(cfg: PlannerConfig) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    service = PlannerService(cfg, make_actuator(cfg))
    try:
        service.start()
        print("TANDEM_READY " + json.dumps({"role": "planner", "metrics_port": service.metrics_port,
                                            "target": cfg.target}), flush=True)
        service.run(stop)
    finally:
        service.close()
    log.info("planner stopped")
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        cfg = PlannerConfig.from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return serve(cfg)
