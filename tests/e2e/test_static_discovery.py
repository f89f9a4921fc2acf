"""Static discovery in disaggregated mode: `tandem router --prefill ADDR --decode ADDR`, no Redis, workers
with their default ids (ROLE-HOSTNAME-PID). The router knows a listed worker only by its address; it
must pair by the worker's own id and boot epoch (which the decode worker's receiver checks in the
bootstrap handshake), learned from WorkerIdentity, and learn them again when the worker restarts."""

from __future__ import annotations

import time

import grpc
import pytest

from tandem.v1 import generation_pb2, generation_pb2_grpc
from tests.e2e.stack import Service

pytestmark = pytest.mark.timeout(300)

ENGINE = ("--dtype", "float32", "--page-size", "4", "--max-total-tokens", "2048", "--num-threads", "1")


def worker(role: str, model, port: int = 0) -> Service:
    return Service("tandem.cli", role, "--model", str(model), *ENGINE, "--port", str(port), "--metrics-port", "-1")


def generate(stub, prompt: list[int]) -> list[int]:
    req = generation_pb2.GenerateRequest(sampling=generation_pb2.SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    req.token_ids.ids.extend(prompt)
    return [t for chunk in stub.Generate(req, timeout=60) for t in chunk.token_ids]


def wait_for_line(service: Service, text: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(text in line for line in list(service.log)):
        assert time.monotonic() < deadline, f"{text!r} not seen:\n" + "\n".join(service.log)
        time.sleep(0.1)


def test_static_lists_pair_by_the_workers_identity_and_follow_a_restart(tiny_llama):
    prefill, decode = worker("prefill", tiny_llama), worker("decode", tiny_llama)
    router = None
    try:
        p, d = prefill.wait_ready(120), decode.wait_ready(120)
        assert p["worker_id"] != p["grpc_addr"] and p["worker_id"].startswith("prefill-")   # the default id
        router = Service("tandem.cli", "--log-level", "INFO", "router", "--port", "0", "--prefill", p["grpc_addr"],
                         "--decode", d["grpc_addr"], "--probe-interval", "0.2", "--local-prefill-max-tokens", "-1")
        with grpc.insecure_channel(router.wait_ready()["grpc_addr"]) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            first = generate(stub, [5, 6, 7, 8, 9, 10, 11])
            assert len(first) == 4
            wait_for_line(router, f"prefill={p['worker_id']} decode={d['worker_id']}")

            # The prefill worker restarts at the same address: a new process, id and boot epoch.
            prefill.close()
            prefill = worker("prefill", tiny_llama, port=int(p["grpc_addr"].rsplit(":", 1)[1]))
            again = prefill.wait_ready(120)
            assert again["grpc_addr"] == p["grpc_addr"] and again["worker_id"] != p["worker_id"]
            assert again["boot_epoch"] != p["boot_epoch"]
            wait_for_line(router, f"+['{again['worker_id']}']")
            assert generate(stub, [5, 6, 7, 8, 9, 10, 11]) == first      # greedy, the same model
            wait_for_line(router, f"prefill={again['worker_id']} decode={d['worker_id']}")
    finally:
        for service in (router, prefill, decode):
            if service is not None:
                service.close()
