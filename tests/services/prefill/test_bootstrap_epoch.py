"""The bootstrap handshake checks instance identity: a Bootstrap meant for an earlier instance of a
prefill worker (same address and worker id, restarted) is refused at once, and a decode worker that
restarted under the same id is asked for fresh transfer metadata."""

from __future__ import annotations

import asyncio

from tandem.services.prefill.servicer import BootstrapServicer
from tandem.v1 import worker_pb2
from tests.services.common.conftest import arun


class Loop:
    """EngineLoop stand-in: runs the command at once on the caller's event loop."""

    async def _run(self, fn):
        return fn()

    def call(self, fn):
        return asyncio.ensure_future(self._run(fn))


class Worker:
    page_size = 4

    def __init__(self):
        self.bootstrapped = []

    def bootstrap(self, room, info):
        self.bootstrapped.append((room, info.peer_id, info.dst_pages))


class Sender:
    def __init__(self):
        self.peers = {}

    def connect(self, peer, metadata):
        self.peers[peer] = metadata

    def has_peer(self, peer):
        return peer in self.peers

    def transports(self, peer):
        return []


def req(room, prefill_epoch, decode_epoch=7, metadata=b"", peer="d0"):
    return worker_pb2.BootstrapRequest(bootstrap_room=room, decode_worker_id=peer, transfer_metadata=metadata,
                                       dst_page_ids=[1, 2], page_size=4, prefill_boot_epoch=prefill_epoch,
                                       decode_boot_epoch=decode_epoch)


def test_stale_prefill_epoch_is_rejected_and_the_room_never_created():
    async def body():
        worker, sender = Worker(), Sender()
        svc = BootstrapServicer(worker, Loop(), sender, boot_epoch=0xBEEF)
        stale = await svc.Bootstrap(req(1, prefill_epoch=0xDEAD, metadata=b"md"), None)
        assert not stale.accepted and stale.stale_epoch
        assert "stale prefill instance" in stale.error and "dead" in stale.error and "beef" in stale.error
        assert worker.bootstrapped == [] and sender.peers == {}  # nothing touched
        ok = await svc.Bootstrap(req(2, prefill_epoch=0xBEEF, metadata=b"md"), None)
        assert ok.accepted and not ok.stale_epoch
        unchecked = await svc.Bootstrap(req(3, prefill_epoch=0), None)  # a router that knows no epoch
        assert unchecked.accepted
        assert [r for r, _, _ in worker.bootstrapped] == [2, 3]

    arun(body())


def test_a_restarted_decode_worker_is_asked_for_fresh_metadata():
    async def body():
        worker, sender = Worker(), Sender()
        svc = BootstrapServicer(worker, Loop(), sender, boot_epoch=5)
        assert (await svc.Bootstrap(req(1, 5, decode_epoch=7, metadata=b"old"), None)).accepted
        assert (await svc.Bootstrap(req(2, 5, decode_epoch=7), None)).accepted       # cached metadata
        again = await svc.Bootstrap(req(3, 5, decode_epoch=8), None)                  # same id, new process
        assert not again.accepted and again.need_metadata
        assert (await svc.Bootstrap(req(3, 5, decode_epoch=8, metadata=b"new"), None)).accepted
        assert sender.peers["d0"] == b"new"

    arun(body())
