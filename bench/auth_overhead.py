"""What the internal secret costs: gRPC calls through the auth interceptors against plain ones, and
the KV transfer connect (challenge + HMAC hello) with and without a key, in one process, one run.

    python -m tandem.bench.auth_overhead --out bench/results/auth_overhead.json

Measured, each way in alternating rounds so the shared machine's drift hits both alike:
- unary round trip (WorkerIdentity.GetWorkerInfo) p50/p90, µs;
- a server stream of small messages (what the router relays from a decode worker), messages/s,
  read with `call.read()`;
- `KVSender.connect` to a fresh tcp receiver (TCP connect + handshake), p50, µs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time

import grpc

from tandem.bench.flags import add_out_flag
from tandem.bench.results import write_result
from tandem.services.common.auth import InternalAuth
from tandem.v1 import generation_pb2, worker_pb2, worker_pb2_grpc

TOKEN = b"bench-internal-secret-0123456789abcdef"


class _Servicer(worker_pb2_grpc.WorkerIdentityServicer, worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, stream_len: int):
        self.stream_len = stream_len

    async def GetWorkerInfo(self, request, context):
        return worker_pb2.WorkerInfo(worker_id="w")

    async def Decode(self, request, context):
        msg = generation_pb2.GenerateResponse(token_ids=[1], text="x")
        for _ in range(self.stream_len):
            yield msg


async def _grpc_round(auth: InternalAuth, calls: int, stream_len: int) -> tuple[list[float], float]:
    server = grpc.aio.server(interceptors=[auth.server_interceptor()])
    servicer = _Servicer(stream_len)
    worker_pb2_grpc.add_WorkerIdentityServicer_to_server(servicer, server)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with auth.channel(f"127.0.0.1:{port}") as channel:
            identity = worker_pb2_grpc.WorkerIdentityStub(channel)
            await identity.GetWorkerInfo(worker_pb2.WorkerInfoRequest())           # connect, warm up
            rtts = []
            for _ in range(calls):
                t0 = time.perf_counter()
                await identity.GetWorkerInfo(worker_pb2.WorkerInfoRequest())
                rtts.append((time.perf_counter() - t0) * 1e6)
            call = worker_pb2_grpc.DecodeWorkerStub(channel).Decode(worker_pb2.DecodeRequest())
            t0 = time.perf_counter()
            n = 0
            while (await call.read()) is not grpc.aio.EOF:
                n += 1
            rate = n / (time.perf_counter() - t0)
    finally:
        await server.stop(0)
    return rtts, rate


def _connects(keys: dict[str, bytes | None], rounds: int) -> dict[str, list[float]]:
    """`KVSender.connect` to a fresh tcp receiver, µs, each way in turn every round."""
    import torch

    from tandem.kvtransfer import create_receiver, create_sender
    from tandem.kvtransfer.base import PoolLayout

    layout = PoolLayout(num_layers=2, num_pages=8, page_size=4, kv_heads=2, head_dim=8, dtype="float32")
    senders = {w: create_sender("tcp", torch.zeros(layout.shape), layout, f"P-{w}", secret=k) for w, k in keys.items()}
    out: dict[str, list[float]] = {w: [] for w in keys}
    try:
        for i in range(rounds + 1):                          # round 0 warms up and is not counted
            for w in (list(keys) if i % 2 == 0 else list(reversed(keys))):
                rx = create_receiver("tcp", layout, "127.0.0.1", f"D-{w}-{i}", secret=keys[w])
                try:
                    t0 = time.perf_counter()
                    senders[w].connect(rx.worker_id, rx.metadata())
                    if i:
                        out[w].append((time.perf_counter() - t0) * 1e6)
                finally:
                    rx.close()
    finally:
        for tx in senders.values():
            tx.close()
    return out


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds per way (default 6)")
    ap.add_argument("--calls", type=int, default=500, help="unary calls per round (default 500)")
    ap.add_argument("--stream-len", type=int, default=20000, help="messages per stream per round (default 20000)")
    ap.add_argument("--connects", type=int, default=30, help="KV connects per way (default 30)")
    add_out_flag(ap, "bench/results/auth_overhead.json", help="JSON output path")
    args = ap.parse_args()

    ways = {"plain": InternalAuth(), "secret": InternalAuth(TOKEN)}
    rtts: dict[str, list[float]] = {w: [] for w in ways}
    rates: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(args.rounds):
        for name in (list(ways) if r % 2 == 0 else list(reversed(ways))):
            rt, rate = asyncio.run(_grpc_round(ways[name], args.calls, args.stream_len))
            rtts[name] += rt
            rates[name].append(rate)
    connects = _connects({"plain": None, "secret": InternalAuth(TOKEN).transfer_key}, args.connects)
    result = {
        "machine": platform.node(), "args": vars(args),
        "unary_rtt_us": {w: {"p50": round(_p(v, 50), 1), "p90": round(_p(v, 90), 1)} for w, v in rtts.items()},
        "stream_msgs_per_s": {w: round(statistics.median(v)) for w, v in rates.items()},
        "kv_connect_us_p50": {w: round(_p(v, 50), 1) for w, v in connects.items()},
    }
    write_result(args.out, result, tool="tandem.bench.auth_overhead")
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "args")}, indent=2))


if __name__ == "__main__":
    main()
