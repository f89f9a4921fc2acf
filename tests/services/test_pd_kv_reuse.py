"""KV both ways, in one process over real transfers both ways (every backend for the main case) (no gRPC: D's SendPrefix is called
directly; tests/e2e/test_kv_reuse_e2e.py runs the gRPC path through `tandem up`).

Turn 2 of a conversation repeats turn 1's answer, which only D computed. With reuse, P fetches the
pages D holds beyond its own cache instead of computing them: the greedy tokens equal the co-located
engine's, P reports the fetched tokens, and everything is freed on both sides. A refused fetch, or one
whose bytes arrive corrupt (the receiver's checksums), is computed instead, with the same tokens."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.engine.engine import LLMEngine
from tandem.engine.errors import InvalidRequest
from tandem.engine.sampling_params import SamplingParams
from tandem.kvtransfer import create_receiver, create_sender
from tandem.services.decode.worker import DecodeRoom, DecodeTimeouts, DecodeWorker
from tandem.services.prefill.kv_fetch import KVFetcher
from tandem.services.prefill.rooms import BootstrapInfo
from tandem.services.prefill.worker import PrefillTimeouts, PrefillWorker
from tandem.services.worker.layout import layout_of
from tandem.v1 import worker_pb2
from tests.services.test_pd_workers import BASE, drive

TURN1 = [(7 * i + 3) % 500 + 3 for i in range(36)]   # 9 full pages of 4
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
NEW = [31, 32, 33, 34, 35]


class Peers:
    """D's Bootstrap reaches P directly; P's SendPrefix reaches D directly (`refuse`: D says no)."""

    def __init__(self, prefill: PrefillWorker, decode_rx, refuse: bool = False):
        self.prefill, self.decode_rx, self.refuse = prefill, decode_rx, refuse
        self.decode: DecodeWorker | None = None
        self.asked = 0

    def send_bootstrap(self, room: DecodeRoom, req: worker_pb2.BootstrapRequest) -> None:
        self.prefill.sender.connect("d", self.decode_rx.metadata())
        self.prefill.bootstrap(room.room, BootstrapInfo("d", list(req.dst_page_ids), req.decode_prefix_len, "d:0"))
        self.decode.bootstrap_done(room.room, None)

    def send_abort(self, room: DecodeRoom, reason: str) -> None:
        self.prefill.abort_room(room.room, reason)

    def ask(self, src, req: worker_pb2.SendPrefixRequest) -> None:
        self.asked += 1
        try:
            if self.refuse:
                raise InvalidRequest("refused by the test", "bootstrap_room")
            self.decode.prefix_sender.connect("p", req.transfer_metadata)
            self.decode.send_prefix(req.bootstrap_room, "p", req.first_page, list(req.dst_page_ids))
        except InvalidRequest as e:
            self.prefill.fetcher.refused(src, str(e))


@pytest.fixture
def make(tiny_llama):
    closers = []

    def build(reuse: bool = True, refuse: bool = False, backend: str = "tcp", **d_sender_options):
        rx = {}

        def allocate(name):
            def fn(spec):
                rx[name] = create_receiver(backend, layout_of(spec), "127.0.0.1", name)
                return rx[name].buffer
            return fn

        cfg = dataclasses.replace(BASE, model=str(tiny_llama))
        engine_p = LLMEngine(dataclasses.replace(cfg, init_new_token_ratio=0, min_new_token_ratio=0),
                             kv_allocator=allocate("p"))
        engine_d = LLMEngine(cfg, kv_allocator=allocate("d"))
        spec = layout_of(engine_p.runner.pool.spec)
        sender_p = create_sender(backend, rx["p"].buffer, spec, "p")
        fetcher = KVFetcher("p", rx["p"], BASE.page_size, timeout_s=5.0)
        prefill = PrefillWorker(engine_p, sender_p, PrefillTimeouts(bootstrap_s=5.0, transfer_s=5.0),
                                fetcher=fetcher if reuse else None)
        peers = Peers(prefill, rx["d"], refuse)
        fetcher.ask = peers.ask
        decode = DecodeWorker(engine_d, rx["d"], DecodeTimeouts(transfer_s=5.0), peers)
        decode.prefix_sender = create_sender(backend, rx["d"].buffer, spec, "d", **d_sender_options)
        peers.decode = decode
        closers.extend([sender_p.close, decode.prefix_sender.close, rx["p"].close, rx["d"].close,
                        engine_p.close, engine_d.close])
        return prefill, decode, peers

    yield build
    for close in closers:
        close()


@pytest.fixture(scope="module")
def colocated(tiny_llama) -> tuple[list[int], list[int]]:
    """Turn 1's answer and turn 2's, from one co-located engine (its prefix cache keeps turn 1)."""
    engine = LLMEngine(dataclasses.replace(BASE, model=str(tiny_llama)))
    try:
        first = engine.generate([TURN1], GREEDY)[0].token_ids
        return first, engine.generate([TURN1 + first + NEW], GREEDY)[0].token_ids
    finally:
        engine.close()


def converse(prefill, decode, first_answer=None):
    """Turn 1, then turn 2 (turn 1 + its answer + NEW) with reuse asked for; returns both answers
    and turn 2's PrefillResponse."""
    results, responses, answers = {}, [], []
    for i in range(2):
        prompt = TURN1 if i == 0 else TURN1 + answers[0] + NEW
        rid = f"t{i}"
        prefill.add_prefill(40 + i, rid, prompt, GREEDY, responses.append, reuse_decode_kv=True)
        decode.add(DecodeRoom(40 + i, decode.engine.make_request(prompt, GREEDY, rid), "p:0", "p",
                              results.setdefault(rid, []).append))
        drive(prefill, decode, lambda n=i + 1: len(responses) == n and not decode.streams)
        answers.append([t for o in results[rid] for t in o.token_ids])
    assert all(r.state == worker_pb2.TRANSFER_STATE_SUCCESS for r in responses), responses
    return answers, responses[1]


def check_idle(prefill, decode):
    prefill.engine.check_idle()
    decode.engine.check_idle()
    assert not prefill.rooms and not decode.transfer


@pytest.mark.parametrize("backend", ["tcp", "shm", "nixl", "ucx"])
def test_turn_two_fetches_the_answer_from_decode(make, colocated, backend):
    prefill, decode, peers = make(backend=backend)
    answers, turn2 = converse(prefill, decode)
    assert answers == list(colocated)
    # P held turn 1's 9 pages; D held those and 11 answer tokens' KV: 2 more full pages, fetched.
    assert peers.asked == 1 and turn2.fetched_tokens == 8 and turn2.cached_tokens == 44
    assert prefill.engine.scheduler.kv.num_fetched_pages == 2
    assert prefill.fetcher.gbps > 0
    check_idle(prefill, decode)


def _corrupt(room: int) -> bool:
    return True


@pytest.mark.parametrize("options, asked", [
    (dict(reuse=False), 0),            # the worker fetches nothing: P computes turn 1's answer again
    (dict(refuse=True), 1),            # D refuses (its room gone, its pages moved): computed
    (dict(corrupt=_corrupt), 1),       # the bytes arrive corrupt: P's receiver checksums refuse them
], ids=["no-reuse", "refused", "corrupt"])
def test_a_fetch_not_made_or_failed_is_computed(make, colocated, options, asked):
    prefill, decode, peers = make(**options)
    answers, turn2 = converse(prefill, decode)
    assert answers == list(colocated)
    assert peers.asked == asked and turn2.fetched_tokens == 0 and turn2.cached_tokens == 36
    assert prefill.engine.scheduler.kv.num_fetched_pages == 0
    if "corrupt" in options:
        assert sum(prefill.fetcher.receiver.integrity_by_path.values()) == 1
    check_idle(prefill, decode)
