"""observe.py on real Prometheus text: the router's own metrics, rendered and parsed twice."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from tandem.services.planner.observe import RouterObserver, histogram_quantile
from tandem.services.router.metrics import RouterMetrics
from tandem.v1 import worker_pb2


def _worker(wid, role, cost=None, **load):
    info = worker_pb2.WorkerInfo(worker_id=wid, role=role, load=worker_pb2.WorkerLoad(**load))
    if cost is not None:
        info.load.step_cost.CopyFrom(worker_pb2.StepCost(base_s=cost[0], per_decode_row_s=cost[1],
                                                         per_prefill_token_s=cost[2], steps=10))
    return info


class Feed:
    """The router's /metrics as the planner fetches it, with a clock the test moves."""

    def __init__(self):
        self.metrics = RouterMetrics()
        self.t = 100.0
        self.fail = False

    def fetch(self) -> str:
        if self.fail:
            raise OSError("connection refused")
        return generate_latest(self.metrics.registry).decode()


def _observer(feed: Feed) -> RouterObserver:
    return RouterObserver("http://router/metrics", fetch=feed.fetch, clock=lambda: feed.t)


def test_an_interval_is_the_difference_of_two_scrapes():
    feed = Feed()
    m = feed.metrics
    workers = [_worker("p0", worker_pb2.WORKER_ROLE_PREFILL, (0.02, 0.0, 0.001), prefill_tokens=300,
                       free_pages=90, total_pages=100),
               _worker("d0", worker_pb2.WORKER_ROLE_DECODE, (0.03, 0.002, 0.0), running=4, free_pages=20,
                       total_pages=100),
               _worker("d1", worker_pb2.WORKER_ROLE_DECODE, (0.05, 0.004, 0.0), running=2)]
    m.watch_workers(lambda: workers)
    for _ in range(7):            # before the interval: must not count
        m.arrivals.inc()
        m.ttft.observe(9.0)
    observer = _observer(feed)
    assert observer.observe() is None   # the first scrape only starts an interval

    for _ in range(20):
        m.arrivals.inc()
    for ttft in [0.3] * 10 + [0.9] * 10:
        m.ttft.observe(ttft)
    for prompt, out in ((100, 10), (300, 30)):
        m.prompt_tokens.observe(prompt)
        m.output_tokens.observe(out)
    m.observe_itl(0.2, 4)         # 4 gaps of 0.05
    feed.t += 10
    o = observer.observe()
    assert o.interval_s == pytest.approx(10) and o.arrival_rate == pytest.approx(2.0)
    assert (o.finished, o.prompt_tokens, o.output_tokens) == (2, 200, 20)
    assert o.ttft_samples == 20
    assert 0.25 <= o.ttft_p50 <= 0.375 and 0.75 <= o.ttft_p90 <= 1.0   # the old 9 s are not in it
    assert o.itl_mean == pytest.approx(0.05) and 0.04 <= o.itl_p90 <= 0.05
    assert o.queued_prefill_tokens == 300 and o.kv_usage == pytest.approx(0.8)
    assert o.workers == {"prefill": 1, "decode": 2} and o.running == {"prefill": 0, "decode": 6}
    assert o.step_costs["prefill"].per_token_s == pytest.approx(0.001)
    assert o.step_costs["decode"].base_s == pytest.approx(0.04) and o.step_costs["decode"].per_row_s == \
        pytest.approx(0.003)   # the mean of its workers

    feed.t += 10                  # nothing happened: rates 0, no lengths
    o = observer.observe()
    assert o.arrival_rate == 0 and o.prompt_tokens is None and o.ttft_p90 is None and o.ttft_samples == 0


def test_a_router_restart_counts_from_zero_and_an_outage_restarts_the_interval():
    feed = Feed()
    for _ in range(50):
        feed.metrics.arrivals.inc()
    observer = _observer(feed)
    observer.observe()
    feed.metrics = RouterMetrics()    # restarted: counters begin again
    for _ in range(5):
        feed.metrics.arrivals.inc()
    feed.t += 5
    assert observer.observe().arrival_rate == pytest.approx(1.0)
    feed.fail = True
    assert observer.observe() is None and "connection refused" in observer.error
    feed.fail = False
    assert observer.observe() is None and observer.error is None   # a new interval starts


def test_histogram_quantile_interpolates_within_the_bucket():
    buckets = [(0.1, 0.0), (0.2, 10.0), (0.4, 20.0), (float("inf"), 20.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.2)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.15)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.3)
    assert histogram_quantile(0.99, [(1.0, 1.0), (float("inf"), 10.0)]) == 1.0   # beyond the last bound
    assert histogram_quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None
