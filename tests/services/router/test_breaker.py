"""Circuit breakers: open after consecutive failures, half-open after the cooldown, panic when all open."""

from __future__ import annotations

import asyncio

import grpc

from tandem.services.router.breaker import Breakers
from tandem.v1 import worker_pb2
from tests.services.common.conftest import arun
from tests.services.router.fakes import FakeDecode, FakePrefill
from tests.services.router.test_router import BASE, _collect, _metric, _req, cluster


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _w(wid: str, epoch: int = 1) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(worker_id=wid, boot_epoch=epoch)


def test_opens_after_threshold_and_half_opens_after_cooldown():
    clock = Clock()
    b = Breakers(failure_threshold=2, cooldown_s=5, max_cooldown_s=12, clock=clock)
    a, other = _w("a"), _w("b")
    b.on_failure(a, "x")
    assert not b.is_open(a)                    # one failure is not a pattern
    b.on_success(a)
    b.on_failure(a, "x")
    assert not b.is_open(a)                    # the success reset the count
    b.on_failure(a, "x")
    assert b.is_open(a) and b.healthy([a, other]) == [other] and b.open_count() == 1
    clock.t += 5
    assert not b.is_open(a)                    # half-open: gets requests again
    b.on_failure(a, "x")                       # one failure re-opens it, for twice as long
    clock.t += 9
    assert b.is_open(a)
    clock.t += 1.1
    b.on_failure(a, "x")
    clock.t += 11.9
    assert b.is_open(a)                        # capped at max_cooldown_s = 12
    clock.t += 0.2
    b.on_success(a)
    assert not b.is_open(a) and b.open_count() == 0


def test_all_open_means_all_used_and_a_restarted_worker_starts_clean():
    b = Breakers(failure_threshold=1, cooldown_s=5)
    a, c = _w("a"), _w("c")
    b.on_failure(a, "x")
    b.on_failure(c, "x")
    assert b.healthy([a, c]) == [a, c]         # panic: never a total outage of our own making
    assert not b.is_open(_w("a", epoch=2))      # same id, new process
    b.retain([_w("a", epoch=2)])
    assert b.open_count() == 0


def test_router_skips_a_worker_whose_circuit_opened():
    async def body():
        bad = FakeDecode(grpc.StatusCode.UNAVAILABLE, error="decode is broken")
        good = FakeDecode(tokens=(5,))
        cfg = BASE.__class__(**{**BASE.__dict__, "cb_failure_threshold": 2, "cb_timeout_s": 60.0})
        async with cluster([FakePrefill(), FakePrefill()], [bad, good], config=cfg) as (router, stub):
            for _ in range(8):
                out = await _collect(stub, _req())
                assert [t for m in out for t in m.token_ids] == [5]   # retried on the good pair
            await asyncio.sleep(0.05)
            # Round robin would send every other request to `bad`; after 2 failures it is skipped.
            assert len(bad.requests) == 2
            assert _metric(router, "tandem_router_open_circuits") == 1

    arun(body())


def test_a_decode_failure_due_to_its_prefill_peer_is_retried_without_that_prefill():
    class BlamesPrefill(FakeDecode):
        """Fails the first attempt the way a decode worker whose prefill peer died does."""

        async def _decode(self, request, context):
            if len(self.requests) == 1:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker is unreachable",
                                    (("tandem-failed-worker", request.prefill_worker_id),))
            await super()._decode(request, context)

    async def body():
        p0, p1, d = FakePrefill("hang"), FakePrefill(), BlamesPrefill(tokens=(4,))
        async with cluster([p0, p1], [d]) as (router, stub):
            out = await _collect(stub, _req())
            assert [t for m in out for t in m.token_ids] == [4]
            # The only decode worker is used again; the blamed prefill worker is not.
            assert len(d.requests) == 2 and d.requests[1].prefill_worker_id == p1.addr
            assert _metric(router, "tandem_router_retries_total") == 1

    arun(body())


def test_up_forwards_the_retry_and_breaker_flags_to_the_router():
    from tandem.cli.main import build_parser
    from tandem.cli.up_cmd import router_args
    from tandem.services.router.config import RouterConfig

    up = build_parser().parse_args(["up", "--retry-max-retries", "2", "--cb-failure-threshold", "7",
                                    "--cb-timeout-duration-secs", "1.5", "--disable-circuit-breaker"])
    cfg = RouterConfig.from_args(build_parser().parse_args(["router", "--prefill", "a:1", "--decode", "b:2",
                                                            *router_args(up)]))
    assert (cfg.max_retries, cfg.cb_failure_threshold, cfg.cb_timeout_s, cfg.circuit_breaker) == (2, 7, 1.5, False)
    default = RouterConfig.from_args(build_parser().parse_args(["router", "--prefill", "a:1", "--decode", "b:2"]))
    assert default.circuit_breaker and default.max_retries == 1
