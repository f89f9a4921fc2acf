"""The KV-event messages as both sides read them: JSON round trips, and malformed ones refused."""

from __future__ import annotations

import json

import pytest

from tandem.kvblocks.blocks import Tier
from tandem.kvblocks.events import BlockEvent, BlockRef, KVEventBatch, KVSnapshot, message_from_dict
from tandem.kvblocks.keys import Namespace, block_hashes

NS = Namespace(model="tandem-test-model", dtype="bfloat16", page_size=4, num_layers=2, kv_heads=1, head_dim=8)
KEYS = block_hashes(NS, list(range(4 * 16)))


def test_messages_round_trip_through_json():
    batch = KVEventBatch("w0", 9, 3, (BlockEvent("stored", KEYS[1].hex(), KEYS[0].hex(), Tier.DISK),
                                      BlockEvent("removed", KEYS[0].hex(), None, Tier.DEVICE)))
    snap = KVSnapshot("w0", 9, 3, (BlockRef(KEYS[0].hex(), None, Tier.DEVICE), BlockRef(KEYS[1].hex(), KEYS[0].hex(), Tier.HOST),
                                   BlockRef(KEYS[0].hex(), None, Tier.DISK)))
    for msg in (batch, snap):
        assert message_from_dict(json.loads(json.dumps(msg.to_dict()))) == msg
    assert set(snap.to_dict()["blocks"]) == {"device", "host", "disk"}, "a snapshot lists its blocks per tier"
    for bad in ({}, {"type": "batch"}, {"type": "snapshot", "worker_id": "w", "epoch": 1, "seq": 0, "blocks": []},
                {"type": "batch", "worker_id": "w", "epoch": 1, "seq": 1, "events": [["stored", "k", None, "gpu"]]},
                {"type": "batch", "worker_id": "w", "epoch": 1, "seq": 1, "events": [["evicted", "k", None, "host"]]}):
        with pytest.raises(ValueError):
            message_from_dict(bad)
