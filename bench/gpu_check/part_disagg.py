"""Part `disagg`: 1P1D end to end on the GPU with the nixl transfer backend.

A prefill worker and a decode worker on the device (`--device cuda --transfer-backend nixl`) and a
router that finds them from static lists (no Redis needed), all on 127.0.0.1 and sharing an internal
token (a statically listed worker's id is its address: see static_identity); local prefill on the decode worker is off, so every prompt's KV crosses from P to D. Greedy
tokens for a few prompts through the router must equal the co-located engine's in this process on
the same device, and the decode worker must report nixl as its transfer backend.

With `--device cpu` the same runs without a GPU (DRAM pools), which is how it is exercised off the
GPU machine.
"""

from __future__ import annotations

import collections
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from tandem.bench.gpu_check.report import CheckFailed, main_of, require

ROOT = Path(__file__).resolve().parents[2]
ENGINE_ARGS = ("--dtype", "float32", "--page-size", "4", "--max-total-tokens", "4096", "--chunked-prefill-size", "32")
PROMPT_LENS = (1, 7, 18, 45)
MAX_TOKENS = 8


class Proc:
    """One Tandem process whose output is kept, ready once it printed its TANDEM_READY line."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]):
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "tandem.cli", *argv], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        self.log: collections.deque[str] = collections.deque(maxlen=60)
        self.info: dict | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip()
            self.log.append(line)
            print(f"{self.name}: {line}", flush=True)
            if line.startswith("TANDEM_READY ") and self.info is None:
                self.info = json.loads(line[len("TANDEM_READY "):])
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout_s: float) -> dict:
        self._ready.wait(max(timeout_s, 1.0))
        if self.info is None:
            state = f"exited with {self.proc.poll()}" if self.proc.poll() is not None else f"not ready in {timeout_s:.0f} s"
            last = [line for line in self.log if line.strip()][-6:]
            raise CheckFailed(f"{self.name} {state}: " + " | ".join(last))
        return self.info

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def static_identity() -> list[str]:
    """--port and --worker-id for a worker listed statically: the router knows a static worker by its
    address alone and pairs rooms with that id, so the worker must carry the same one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return ["--port", str(port), "--worker-id", f"127.0.0.1:{port}"]


BIND_TRIES = 3


def ready_static(first: Proc, argv: list[str], env: dict[str, str], timeout_s: float,
                 procs: list[Proc]) -> dict:
    """`first`'s READY info; a worker that lost its picked port before binding it (another process,
    e.g. a UCX listener, took it in between) is started again on a new one, up to BIND_TRIES times."""
    proc = first
    for attempt in range(1, BIND_TRIES + 1):
        try:
            return proc.wait_ready(timeout_s)
        except CheckFailed as e:
            if attempt == BIND_TRIES or proc.proc.poll() is None or "bind" not in str(e).lower():
                raise
        proc = Proc(first.name, [*argv, *static_identity()], env)
        procs.append(proc)
    raise AssertionError("unreachable")


def workload(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def expected_tokens(model: Path, device: str, prompts: list[list[int]]) -> list[list[int]]:
    from tandem.engine.config import EngineConfig
    from tandem.engine.engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", device=device, page_size=4,
                                    max_total_tokens=4096, chunked_prefill_size=32))
    out = [r.token_ids for r in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                          ignore_eos=True))]
    engine.check_idle()
    return out


def generate(router: str, prompt: list[int], timeout_s: float) -> list[int]:
    import grpc

    from tandem.v1 import generation_pb2, generation_pb2_grpc

    with grpc.insecure_channel(router) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        req = generation_pb2.GenerateRequest(sampling=generation_pb2.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
        req.token_ids.ids.extend(prompt)
        ids: list[int] = []
        for chunk in stub.Generate(req, timeout=timeout_s):
            ids.extend(chunk.token_ids)
        return ids


def run(report, args) -> None:
    from tests.fixtures.tiny_models import make_tiny_model

    device = args.device
    if device == "cuda":
        require(torch.cuda.is_available(), "torch sees no CUDA device")
    d = report.details
    env = dict(os.environ, PYTHONUNBUFFERED="1", TANDEM_INTERNAL_TOKEN=secrets.token_hex(20))
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-disagg-") as tmp:
        model = make_tiny_model(Path(tmp) / "tiny", "llama")
        try:
            worker = ["--model", str(model), "--device", device, *ENGINE_ARGS, "--transfer-backend", "nixl",
                      "--host", "127.0.0.1"]
            t0 = time.monotonic()
            prefill = Proc("prefill", ["prefill", *worker, *static_identity()], env)
            decode = Proc("decode", ["decode", *worker, *static_identity()], env)
            procs += [prefill, decode]
            p_info = ready_static(prefill, ["prefill", *worker], env, report.left_s() / 2, procs)
            d_info = ready_static(decode, ["decode", *worker], env, report.left_s() / 2, procs)
            d["workers"] = {"prefill": p_info, "decode": d_info, "ready_s": round(time.monotonic() - t0, 1)}
            report.save()
            require(d_info.get("transfer_backend") == "nixl",
                    f"the decode worker's transfer backend is {d_info.get('transfer_backend')!r}, not nixl")
            router = Proc("router", ["router", "--host", "127.0.0.1", "--port", "0", "--mode", "disagg",
                                     "--prefill", p_info["grpc_addr"], "--decode", d_info["grpc_addr"],
                                     "--local-prefill-max-tokens", "-1"], env)
            procs.append(router)
            addr = router.wait_ready(min(60.0, report.left_s() / 2))["grpc_addr"]
            prompts = workload(512)
            want = expected_tokens(model, device, prompts)
            t1 = time.monotonic()
            got = [generate(addr, p, timeout_s=max(10.0, report.left_s() - 10)) for p in prompts]
            d["requests"] = {"prompt_lens": list(PROMPT_LENS), "max_tokens": MAX_TOKENS, "tokens": got,
                             "expected": want, "seconds": round(time.monotonic() - t1, 2)}
            report.save()
            wrong = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
            require(not wrong, f"1P1D tokens differ from the co-located engine's for prompts {wrong}")
        finally:
            for p in reversed(procs):
                p.stop()


def add_args(p) -> None:
    p.add_argument("--device", default="cuda", help="cuda; cpu exercises the part without a GPU")


if __name__ == "__main__":
    main_of(run, add_args)
