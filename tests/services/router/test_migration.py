"""Mid-stream migration: the ledger's bookkeeping (no sockets), then the router over fake workers."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from tandem.services.router.migration import StreamLedger
from tandem.v1 import generation_pb2
from tests.services.common.conftest import arun
from tests.services.router.fakes import FakeDecode, FakePrefill
from tests.services.router.test_router import BASE, _metric, _req, cluster

S = grpc.StatusCode
LENGTH = generation_pb2.FINISH_REASON_LENGTH


def _chunk(*ids, finish=0, usage=None):
    return generation_pb2.GenerateResponse(token_ids=ids, text="".join(f"<{i}>" for i in ids), finish_reason=finish,
                                           usage=usage)


def test_continuation_resumes_after_exactly_what_was_sent():
    req = _req(max_tokens=10)
    ledger = StreamLedger(req, max_migrations=2)
    assert ledger.why_not(S.UNAVAILABLE, 10) == "not_migratable"  # nothing sent: a retry, not a migration
    ledger.record(_chunk(5))
    ledger.record(_chunk(6, 7))
    assert ledger.why_not(S.UNAVAILABLE, 10) is None
    cont = ledger.continuation()
    assert list(cont.resume_ids) == [5, 6, 7]
    assert cont.sampling.max_tokens == 10  # the worker counts resume_ids against it (one place knows defaults)
    assert cont.text == req.text and not req.resume_ids  # the original is untouched
    ledger.record(_chunk(8))
    cont = ledger.continuation()  # a second migration resumes after everything, not just the last attempt's
    assert list(cont.resume_ids) == [5, 6, 7, 8]
    assert ledger.why_not(S.UNAVAILABLE, 10) == "exhausted"


def test_usage_of_a_migrated_stream_counts_resumed_tokens_as_completion():
    ledger = StreamLedger(_req(max_tokens=4), max_migrations=1)
    ledger.record(_chunk(5, 6))
    ledger.continuation()
    # The continuing worker saw a prompt of 3 + 2 resumed tokens and produced 2.
    last = ledger.record(_chunk(7, 8, finish=LENGTH, usage=generation_pb2.Usage(
        prompt_tokens=5, completion_tokens=2, cached_tokens=5)))
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens) == (3, 4, 3)
    assert ledger.sent_ids == [5, 6, 7, 8] and ledger.finished


@pytest.mark.parametrize("code", [S.INVALID_ARGUMENT, S.RESOURCE_EXHAUSTED, S.CANCELLED, S.INTERNAL])
def test_only_a_broken_stream_is_migrated(code):
    ledger = StreamLedger(_req(), max_migrations=5)
    ledger.record(_chunk(1))
    assert ledger.why_not(code, 3) == "not_migratable"


def test_bounds():
    ledger = StreamLedger(_req(max_tokens=2), max_migrations=0)
    ledger.record(_chunk(1))
    assert ledger.why_not(S.UNAVAILABLE, 2) == "exhausted"
    ledger = StreamLedger(_req(max_tokens=2), max_migrations=1)
    ledger.record(_chunk(1, 2))
    assert ledger.why_not(S.UNAVAILABLE, 2) == "unsupported"  # nothing left to produce
    ledger.record(_chunk(finish=LENGTH))
    assert ledger.why_not(S.UNAVAILABLE, None) == "not_migratable"  # finished


class _Dying(FakeDecode):
    """Streams its first `n` tokens, then its stream breaks with UNAVAILABLE (the worker died)."""

    def __init__(self, n: int, code=S.UNAVAILABLE, **kw):
        super().__init__(**kw)
        self.n, self.code = n, code

    async def _decode(self, request, context):
        for tok in self.tokens[:self.n]:
            await context.write(generation_pb2.GenerateResponse(request_id=request.request_id, token_ids=[tok],
                                                                text=f"<{tok}>"))
        await context.abort(self.code, "worker died")


class _Continuing(FakeDecode):
    """The undisturbed sequence `tokens`, continued after the request's resume_ids (as a worker does)."""

    async def _decode(self, request, context):
        rest = self.tokens[len(request.resume_ids):]
        assert list(request.resume_ids) == list(self.tokens[:len(request.resume_ids)])
        for i, tok in enumerate(rest):
            await context.write(generation_pb2.GenerateResponse(
                request_id=request.request_id, token_ids=[tok], text=f"<{tok}>",
                finish_reason=LENGTH if i == len(rest) - 1 else 0))


def test_a_stream_broken_mid_output_continues_on_another_decode_worker():
    async def body():
        tokens = (11, 12, 13, 14, 15)
        p, d0, d1 = FakePrefill(), _Dying(2, tokens=tokens), _Continuing(tokens=tokens)
        async with cluster([p], [d0, d1]) as (router, stub):
            out = [m async for m in stub.Generate(_req(max_tokens=5))]
            assert [t for m in out for t in m.token_ids] == list(tokens)  # none twice, none missing
            assert "".join(m.text for m in out) == "".join(f"<{t}>" for t in tokens)
            assert [list(r.resume_ids) for r in d1.requests] == [[11, 12]]
            assert [list(r.resume_ids) for r in p.requests] == [[], [11, 12]]  # P prefills prompt + them
            assert _metric(router, "tandem_router_migrations_total", outcome="migrated") == 1
            assert _metric(router, "tandem_router_retries_total") == 0

    arun(body())


def test_a_stream_is_not_migrated_past_the_bound_nor_for_its_own_errors():
    async def body():
        p, d0, d1 = FakePrefill(), _Dying(1, tokens=(11, 12, 13)), FakeDecode()
        config = dataclasses.replace(BASE, max_migrations=0)
        async with cluster([p], [d0, d1], config=config) as (router, stub):
            call = stub.Generate(_req())
            assert list((await call.read()).token_ids) == [11]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == S.UNAVAILABLE
            assert "broke after 1 tokens and was not continued: --max-migrations 0 reached" in info.value.details()
            assert d1.requests == []
            assert _metric(router, "tandem_router_migrations_total", outcome="exhausted") == 1
        p, d0, d1 = FakePrefill(), _Dying(1, code=S.INVALID_ARGUMENT, tokens=(11, 12)), FakeDecode()
        async with cluster([p], [d0, d1]) as (router, stub):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [m async for m in stub.Generate(_req())]
            assert info.value.code() == S.INVALID_ARGUMENT and d1.requests == []

    arun(body())


def test_clients_may_not_set_resume_ids():
    async def body():
        p, d = FakePrefill(), FakeDecode()
        async with cluster([p], [d]) as (_, stub):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [m async for m in stub.Generate(_req(resume_ids=[1]))]
            assert info.value.code() == S.INVALID_ARGUMENT and d.requests == []

    arun(body())
