"""Prefill and decode workers driven in one process, over a real tcp transfer, without gRPC.

Each worker's engine-thread object is stepped by hand, so timeouts and aborts are deterministic.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from prometheus_client import REGISTRY

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.errors import InvalidRequest
from tandem.engine.sampling_params import SamplingParams
from tandem.kvtransfer import create_receiver, create_sender
from tandem.services.decode.worker import DecodeRoom, DecodeTimeouts, DecodeWorker, TransferFailed
from tandem.services.prefill.rooms import BootstrapInfo
from tandem.services.prefill.worker import PrefillTimeouts, PrefillWorker
from tandem.services.worker.layout import layout_of
from tandem.v1 import worker_pb2

BASE = EngineConfig(dtype="float32", page_size=4, max_total_tokens=512, chunked_prefill_size=16)


class DirectPeers:
    """D's way to P without gRPC: call the prefill worker's commands directly."""

    def __init__(self, prefill: PrefillWorker | None, receiver):
        self.prefill, self.receiver, self.aborted = prefill, receiver, []
        self.decode: DecodeWorker | None = None

    def send_bootstrap(self, room: DecodeRoom, req: worker_pb2.BootstrapRequest) -> None:
        if self.prefill is None:
            return  # a prefill worker that never answers
        self.prefill.sender.connect("d", self.receiver.metadata())
        self.prefill.bootstrap(room.room, BootstrapInfo("d", list(req.dst_page_ids), req.decode_prefix_len))
        self.decode.bootstrap_done(room.room, None)

    def send_abort(self, room: DecodeRoom, reason: str) -> None:
        self.aborted.append(room.room)
        if self.prefill is not None:
            self.prefill.abort_room(room.room, reason)


def make_pair(model, prefill_timeouts: PrefillTimeouts, decode_timeouts: DecodeTimeouts, base: EngineConfig = BASE,
              stream_layers: int = 0, **sender_options):
    """A prefill worker "p" and a decode worker "d" over tcp, both engines built from `base`; close
    both transfer ends (and the engines, when `base` has KV tiers) when done."""
    engine_p = LLMEngine(dataclasses.replace(base, model=str(model), init_new_token_ratio=0, min_new_token_ratio=0))
    holder = {}

    def allocate(spec):
        holder["rx"] = create_receiver("tcp", layout_of(spec), "127.0.0.1", "d")
        return holder["rx"].buffer

    engine_d = LLMEngine(dataclasses.replace(base, model=str(model)), kv_allocator=allocate)
    receiver = holder["rx"]
    sender = create_sender("tcp", engine_p.runner.pool.buffer, layout_of(engine_p.runner.pool.spec), "p",
                           **sender_options)
    prefill = PrefillWorker(engine_p, sender, prefill_timeouts, stream_layers=stream_layers)
    peers = DirectPeers(prefill, receiver)
    decode = DecodeWorker(engine_d, receiver, decode_timeouts, peers)
    peers.decode = decode
    return prefill, decode, peers


@pytest.fixture(params=[0, 1], ids=["after-chunks", "streamed-per-layer"])
def pair(tiny_llama, request):
    prefill, decode, peers = make_pair(tiny_llama, PrefillTimeouts(bootstrap_s=0.3, transfer_s=2.0),
                                       DecodeTimeouts(transfer_s=5.0), stream_layers=request.param)
    yield prefill, decode, peers
    prefill.sender.close()
    peers.receiver.close()


def drive(prefill, decode, until, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "workers made no progress"
        for w in (prefill, decode):
            if w is None:
                continue
            w.tick()
            if w.has_work():
                w.step()
        time.sleep(0.001)


def submit(prefill, decode, room_id, prompt, params, results, responses):
    rid = f"r{room_id}"
    if prefill is not None:
        prefill.add_prefill(room_id, rid, prompt, params, responses.append)
    req = decode.engine.make_request(prompt, params, rid)
    decode.add(DecodeRoom(room_id, req, "p:0", "p", results.setdefault(rid, []).append))


def test_tokens_match_the_colocated_engine_and_everything_is_freed(pair, tiny_llama):
    prefill, decode, _ = pair
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 18, 37)]
    results, responses = {}, []
    ranges, write = [], prefill.sender.write
    prefill.sender.write = lambda *a, layers=None: (ranges.append(layers), write(*a, layers=layers))
    for i, p in enumerate(prompts):
        submit(prefill, decode, 100 + i, p, params, results, responses)
    decode.tick()   # D bootstraps every room before P's first step, so every write streams (see the next test)
    drive(prefill, decode, lambda: len(responses) == 3 and not decode.streams)
    colocated = LLMEngine(dataclasses.replace(BASE, model=str(tiny_llama))).generate(prompts, params)
    for i, ref in enumerate(colocated):
        outs = results[f"r{100 + i}"]
        assert [t for o in outs for t in o.token_ids] == ref.token_ids
    assert all(r.state == worker_pb2.TRANSFER_STATE_SUCCESS and r.transfer_bytes > 0 for r in responses)
    layers = prefill.num_layers
    if prefill.stream_layers:   # every write one layer, every layer of every page sent once per chunk
        assert set(ranges) == {(i, i + 1) for i in range(layers)} and len(ranges) % layers == 0, ranges
    else:
        assert set(ranges) == {None}
    prefill.engine.check_idle()
    decode.engine.check_idle()


def test_prefill_fails_the_room_when_decode_never_bootstraps(pair):
    prefill, decode, _ = pair
    responses = []
    prefill.add_prefill(7, "lonely", [5, 6, 7], SamplingParams(max_tokens=4), responses.append)
    drive(prefill, None, lambda: responses)
    assert responses[0].state == worker_pb2.TRANSFER_STATE_FAILED
    assert "bootstrap timed out" in responses[0].error
    assert not prefill.rooms
    prefill.engine.check_idle()


def test_decode_fails_and_frees_pages_when_the_kv_never_arrives(tiny_llama):
    holder = {}

    def allocate(spec):
        holder["rx"] = create_receiver("tcp", layout_of(spec), "127.0.0.1", "d")
        return holder["rx"].buffer

    engine_d = LLMEngine(dataclasses.replace(BASE, model=str(tiny_llama)), kv_allocator=allocate)
    peers = DirectPeers(None, holder["rx"])
    decode = DecodeWorker(engine_d, holder["rx"], DecodeTimeouts(transfer_s=0.2), peers)
    peers.decode = decode
    results = {}
    submit(None, decode, 9, list(range(3, 20)), SamplingParams(max_tokens=4), results, [])
    drive(None, decode, lambda: results["r9"])
    [err] = results["r9"]
    assert isinstance(err, TransferFailed) and "timed out" in str(err)
    assert peers.aborted == [9]  # P is told to drop the room
    engine_d.check_idle()
    holder["rx"].close()


def test_kv_corrupted_on_its_way_is_never_decoded_and_everything_is_freed(tiny_llama):
    """A byte flipped in flight (fault injection, after P's checksum): D's integrity check fails the room
    before it decodes, UNAVAILABLE naming the prefill worker (the router retries without it), counted
    in tandem_kv_integrity_failures_total{backend}; both sides free everything, the other request is
    served exactly."""
    prefill, decode, peers = make_pair(tiny_llama, PrefillTimeouts(bootstrap_s=2.0, transfer_s=2.0),
                                       DecodeTimeouts(transfer_s=5.0), corrupt=lambda room: room == 41)
    try:
        def failures() -> float:
            return REGISTRY.get_sample_value("tandem_kv_integrity_failures_total", {"backend": "tcp"}) or 0.0

        before = failures()
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        prompt = list(range(3, 30))
        results, responses = {}, []
        for room in (41, 42):
            submit(prefill, decode, room, prompt, params, results, responses)
        drive(prefill, decode, lambda: len(responses) == 2 and not decode.streams)
        [err] = results["r41"]
        assert isinstance(err, TransferFailed) and "KV integrity check failed" in str(err), err
        assert err.failed_worker == "p" and "at p:0 over tcp" in str(err)
        assert failures() == before + 1
        ref = LLMEngine(dataclasses.replace(BASE, model=str(tiny_llama))).generate([prompt], params)[0]
        assert [t for o in results["r42"] for t in o.token_ids] == ref.token_ids
        states = sorted(r.state for r in responses)
        assert states == sorted([worker_pb2.TRANSFER_STATE_SUCCESS, worker_pb2.TRANSFER_STATE_FAILED])
        assert not prefill.rooms and not decode.transfer
        prefill.engine.check_idle()
        decode.engine.check_idle()
    finally:
        prefill.sender.close()
        peers.receiver.close()


def test_the_prefill_runs_before_decode_bootstraps_and_goes_whole_when_it_does(pair, tiny_llama):
    prefill, decode, _ = pair
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt, results, responses = list(range(3, 40)), {}, []
    prefill.add_prefill(51, "r51", prompt, params, responses.append)
    room = prefill.rooms[51]
    drive(prefill, None, lambda: room.early_token is not None)     # no decode worker has asked yet
    assert room.computed == len(prompt) and room.next_page == 0 and not responses
    assert room.info is None and prefill.outstanding() == 0
    req = decode.engine.make_request(prompt, params, "r51")
    decode.add(DecodeRoom(51, req, "p:0", "p", results.setdefault("r51", []).append))
    drive(prefill, decode, lambda: responses and not decode.streams)
    assert responses[0].state == worker_pb2.TRANSFER_STATE_SUCCESS and room.waited_bootstrap is not None
    [ref] = LLMEngine(dataclasses.replace(BASE, model=str(tiny_llama))).generate([prompt], params)
    assert [t for o in results["r51"] for t in o.token_ids] == ref.token_ids
    prefill.engine.check_idle()
    decode.engine.check_idle()


def test_a_bootstrap_for_a_room_that_already_failed_is_refused_at_once(pair):
    prefill, _, _ = pair
    responses = []
    prefill.add_prefill(61, "r61", list(range(5, 30)), SamplingParams(max_tokens=3), responses.append)
    prefill.step()                                   # its first chunk, before any Bootstrap
    prefill.abort_request("r61", "the client went away")
    assert responses[0].state == worker_pb2.TRANSFER_STATE_FAILED and not prefill.rooms
    with pytest.raises(InvalidRequest, match="already failed on this prefill worker: aborted: the client"):
        prefill.bootstrap(61, BootstrapInfo("d", [0] * 7, 0))
    assert not prefill.rooms
    prefill.engine.check_idle()


def test_client_cancel_during_transfer_frees_both_sides(pair):
    prefill, decode, peers = pair
    results, responses = {}, []
    submit(prefill, decode, 11, list(range(3, 40)), SamplingParams(max_tokens=30, ignore_eos=True), results, responses)
    decode.tick()  # admitted and bootstrapped, nothing computed yet
    assert 11 in decode.transfer
    decode.cancel("r11")
    assert peers.aborted == [11]
    assert responses and responses[0].state == worker_pb2.TRANSFER_STATE_FAILED
    drive(prefill, decode, lambda: not prefill.rooms and not decode.streams)
    prefill.engine.check_idle()
    decode.engine.check_idle()


def test_a_layer_write_that_cannot_be_queued_fails_only_its_room_and_frees_both_sides(tiny_llama):
    prefill, decode, peers = make_pair(tiny_llama, PrefillTimeouts(bootstrap_s=5, transfer_s=5),
                                       DecodeTimeouts(transfer_s=5.0), stream_layers=1)
    try:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        results, responses = {}, []
        write = prefill.sender.write

        def flaky(peer, room, src, dst, layers=None):
            if room == 41 and layers and layers[0] == 1:
                raise RuntimeError("no buffer for it")
            write(peer, room, src, dst, layers=layers)

        prefill.sender.write = flaky
        for room in (41, 42):
            submit(prefill, decode, room, list(range(3, 30)), params, results, responses)
        drive(prefill, decode, lambda: len(responses) == 2 and not decode.streams and not decode.transfer)
        by_room = {r.bootstrap_room: r for r in responses}
        assert by_room[41].state == worker_pb2.TRANSFER_STATE_FAILED and "no buffer for it" in by_room[41].error
        assert by_room[42].state == worker_pb2.TRANSFER_STATE_SUCCESS
        assert len([t for o in results["r42"] for t in o.token_ids]) == 4
        assert isinstance(results["r41"][-1], Exception)
        prefill.engine.check_idle()
        decode.engine.check_idle()
    finally:
        prefill.sender.close()
        peers.receiver.close()


def test_a_lost_peer_fails_only_its_own_rooms_on_both_sides(pair):
    prefill, decode, peers = pair
    # D waits on two prefill workers; only "gone" is lost.
    results = {}
    for room, pid in ((21, "gone"), (22, "p")):
        req = decode.engine.make_request(list(range(3, 12)), SamplingParams(max_tokens=3), f"r{room}")
        decode.add(DecodeRoom(room, req, f"{pid}:1", pid, results.setdefault(f"r{room}", []).append))
    assert decode.watched_peers() == {"gone": "gone:1", "p": "p:1"}
    decode.peer_lost("gone", "its liveness probe failed 3 times")
    [err] = results["r21"]
    assert isinstance(err, TransferFailed) and "prefill worker gone is unreachable" in str(err)
    assert err.failed_worker == "gone"                 # the router blames (and avoids) the prefill worker
    assert results["r22"] == [] and "r22" in decode.streams
    decode.cancel("r22")
    decode.engine.check_idle()

    # P owes KV to decode worker "d" (bootstrapped, with its address) and is lost.
    responses = []
    prefill.sender.connect("d", peers.receiver.metadata())
    prefill.add_prefill(31, "q31", [5, 6, 7], SamplingParams(max_tokens=2), responses.append)
    prefill.bootstrap(31, BootstrapInfo("d", [0], 0, "d:9"))
    assert prefill.watched_peers() == {"d": "d:9"}
    prefill.peer_lost("d", "its liveness probe failed 3 times")
    assert responses[0].state == worker_pb2.TRANSFER_STATE_FAILED
    assert "decode worker d is unreachable" in responses[0].error
    assert not prefill.rooms and prefill.watched_peers() == {}
    prefill.engine.check_idle()


def test_local_prefill_on_the_decode_worker_beside_a_transferred_request(pair, tiny_llama):
    # Conditional disaggregation: one prompt comes from P, two are prefilled by D itself while the
    # first decodes; the same greedy tokens as the co-located engine, a cancel mid-prefill frees
    # everything, and usage reports D's own prefix-cache hit on the local route.
    prefill, decode, peers = pair
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    remote, local = list(range(3, 40)), list(range(3, 27))
    results, responses = {}, []
    submit(prefill, decode, 1, remote, params, results, responses)
    drive(prefill, decode, lambda: results.get("r1"))  # the remote one is decoding
    for rid, prompt in (("l1", local), ("l2", list(range(50, 90)))):
        req = decode.engine.make_request(prompt, params, rid)
        decode.add_local(DecodeRoom(0, req, "", "", results.setdefault(rid, []).append))
    decode.tick()
    decode.step()  # l2 got its first chunk (16-token budget) at most
    decode.cancel("l2")
    assert "l2" not in decode.streams and not peers.aborted  # nothing to abort on P: no room
    drive(prefill, decode, lambda: not decode.streams)
    ref = LLMEngine(dataclasses.replace(BASE, model=str(tiny_llama))).generate([remote, local], params)
    assert [t for o in results["r1"] for t in o.token_ids] == ref[0].token_ids
    assert [t for o in results["l1"] for t in o.token_ids] == ref[1].token_ids
    assert results["l1"][-1].usage.cached_tokens == 0
    # The same local prompt again: D's radix cache holds its full pages now (24 tokens = 6 pages).
    again = []
    decode.add_local(DecodeRoom(0, decode.engine.make_request(local, params, "l3"), "", "", again.append))
    drive(prefill, decode, lambda: not decode.streams)
    assert [t for o in again for t in o.token_ids] == ref[1].token_ids
    assert again[-1].usage.cached_tokens == 20  # the last page is recomputed (its logits are needed)
    prefill.engine.check_idle()
    decode.engine.check_idle()


def test_a_room_whose_workers_apply_different_adapters_fails_on_both_sides(tiny_llama, tmp_path):
    """The handshake carries D's adapter digest: P refuses to compute KV for another model."""
    from tests.engine.lora.test_lora_engine import ADAPTERS, make_adapter

    path = make_adapter(tiny_llama, tmp_path / "all8", *ADAPTERS["all8"], seed=0)
    base = dataclasses.replace(BASE, enable_lora=True, lora_modules=(("all8", str(path)),))
    prefill, decode, peers = make_pair(tiny_llama, PrefillTimeouts(bootstrap_s=5, transfer_s=5),
                                       DecodeTimeouts(transfer_s=5.0), base=base)
    try:
        results, responses = {}, []
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        prefill.add_prefill(51, "r51", [5, 6, 7, 8, 9], params, responses.append, lora="all8")
        req = decode.engine.make_request([5, 6, 7, 8, 9], params, "r51")          # D: the base model
        decode.add(DecodeRoom(51, req, "p:0", "p", results.setdefault("r51", []).append))
        drive(prefill, decode, lambda: responses and not decode.streams and not decode.transfer)
        assert responses[0].state == worker_pb2.TRANSFER_STATE_FAILED and "LoRA adapter mismatch" in responses[0].error
        assert isinstance(results["r51"][-1], Exception)
        prefill.engine.check_idle()
        decode.engine.check_idle()
    finally:
        prefill.sender.close()
        peers.receiver.close()
