"""KV transfer between a prefill worker (writer) and a decode worker (owner of the destination pages).

    receiver = create_receiver("auto", layout, host, worker_id)     # D
    sender = create_sender("auto", pool.buffer, layout, worker_id)  # P
    sender.connect(d_id, receiver.metadata()); receiver.expect(room, dst_pages, p_id)
    sender.write(d_id, room, src_pages, dst_pages); sender.finish(d_id, room, aux)
"""

from tandem.kvtransfer.base import (
    KVReceiver,
    KVSender,
    PoolLayout,
    Progress,
    RoomState,
    RoomStatus,
    TransferError,
)
from tandem.kvtransfer.protocol.runs import merge_runs
from tandem.kvtransfer.protocol.shm import cleanup_stale_segments
from tandem.kvtransfer.registry import create_receiver, create_sender

__all__ = [
    "KVReceiver", "KVSender", "PoolLayout", "Progress", "RoomState", "RoomStatus", "TransferError",
    "cleanup_stale_segments", "create_receiver", "create_sender", "merge_runs",
]
