"""A decode worker whose KV tiers hold a room's prefix: the room's Bootstrap (which carries D's
prefix length) waits until that load is done, other work goes on meanwhile, and a room cancelled
while its load is in flight frees everything."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from tandem.services.decode.worker import DecodeTimeouts
from tandem.services.prefill.worker import PrefillTimeouts
from tests.services.test_pd_tiers import A2, GREEDY, SMALL, A, colocated  # noqa: F401  (fixture)
from tests.services.test_pd_workers import drive, make_pair, submit


@pytest.fixture
def warm_pair(tiny_llama):
    """Turn A served, then every page of it on D demoted to L2; D's page writes gated."""
    base = dataclasses.replace(SMALL, kv_host_cache_gb=0.01)
    prefill, decode, peers = make_pair(tiny_llama, PrefillTimeouts(bootstrap_s=1.0, transfer_s=5.0),
                                       DecodeTimeouts(transfer_s=5.0), base)
    results, responses = {}, []
    submit(prefill, decode, 1, A, GREEDY, results, responses)
    drive(prefill, decode, lambda: len(responses) == 1 and not decode.streams)
    kv = decode.engine.scheduler.kv
    kv.cache.evict(kv.num_pages)
    gate = threading.Event()
    tiers = decode.engine.kv_tiers
    real = tiers.write_page
    tiers.write_page = lambda page, payload: (gate.wait(10), real(page, payload))
    bootstraps = []
    send = peers.send_bootstrap
    peers.send_bootstrap = lambda room, req: (bootstraps.append(req), send(room, req))
    yield prefill, decode, gate, bootstraps, results, responses
    gate.set()
    prefill.sender.close()
    peers.receiver.close()
    prefill.engine.close()
    decode.engine.close()


def test_bootstrap_waits_for_the_load_and_carries_the_loaded_prefix(warm_pair, colocated):  # noqa: F811
    prefill, decode, gate, bootstraps, results, responses = warm_pair
    submit(prefill, decode, 2, A2, GREEDY, results, responses)
    for _ in range(5):
        decode.tick()
        prefill.tick()
    assert 2 in decode.loading and 2 not in decode.transfer and bootstraps == []
    assert decode.load().running == 1 and decode.watched_peers() == {"p": "p:0"}
    gate.set()
    drive(prefill, decode, lambda: len(responses) == 2 and not decode.streams)
    assert [b.decode_prefix_len for b in bootstraps] == [36]   # all nine full pages of the prefix, loaded
    assert [t for o in results["r2"] for t in o.token_ids] == colocated[2]
    assert decode.engine.scheduler.kv.num_loaded_pages == 9
    decode.engine.check_idle()


def test_cancel_while_loading_frees_everything(warm_pair):
    prefill, decode, gate, bootstraps, results, responses = warm_pair
    submit(prefill, decode, 3, A2, GREEDY, results, responses)
    decode.tick()
    assert 3 in decode.loading
    threading.Timer(0.1, gate.set).start()   # the page in progress finishes; the rest is cancelled
    decode.cancel("r3")
    assert not decode.loading and not decode.streams and bootstraps == []
    decode.engine.check_idle()
    drive(prefill, decode, lambda: not prefill.rooms, timeout_s=15)   # P's bootstrap timeout frees its side
    prefill.engine.check_idle()
