"""Runtime LoRA through `tandem up --enable-lora-runtime-updating` (co-located, one stack): adapters
are loaded on a worker only when a request needs them; POST /v1/load_lora_adapter and
/v1/unload_lora_adapter need the API key, refuse a malformed adapter (400 saying why) and an unknown
one (404), refuse to unload one that a request in flight uses (409), and show in /v1/models;
requests streaming while adapters are loaded and unloaded (and one evicted) all finish, each with the
text it has alone; the worker reports its adapters (`tandem:lora_requests_info`). Disaggregated, a
runtime load reaches the prefill and the decode worker and the text equals the engine's. With two
workers, the router sends an adapter's requests to the one that has it loaded, base ones by load."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import grpc
import httpx
import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.stack import INTERNAL_METADATA, Stack
from tests.e2e.test_lora import ENGINE
from tests.engine.lora.test_lora_engine import ADAPTERS, _copy, make_adapter

pytestmark = pytest.mark.timeout(600)

KEY = "sk-lora-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [5, 9, 17, 3, 12, 8, 30, 31]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {name: make_adapter(tiny_llama, root / name, *spec, seed=i) for i, (name, spec) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def stack(tiny_llama, adapters):
    s = Stack("--mode", "colocated", "--model", str(tiny_llama), *ENGINE, "--enable-lora",
              "--lora-modules", f"all8={adapters['all8']}", "--max-loras", "2", "--max-cpu-loras", "2",
              "--enable-lora-runtime-updating", "--api-key", KEY, gateway=True)
    yield s
    s.close()


def post(stack, path: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{stack.gateway_url}{path}", json=body, headers=headers, timeout=120)


def models(stack) -> dict[str, str | None]:
    r = httpx.get(f"{stack.gateway_url}/v1/models", headers=AUTH, timeout=10)
    return {m["id"]: m["parent"] for m in r.json()["data"]}


def complete(stack, model: str, max_tokens: int = 6) -> httpx.Response:
    return post(stack, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                          "temperature": 0, "ignore_eos": True})


def stream(stack, model: str, max_tokens: int) -> tuple[str, str | None]:
    """The streamed text and the finish reason."""
    text, finish = "", None
    with httpx.stream("POST", f"{stack.gateway_url}/v1/completions", headers=AUTH, timeout=120, json={
            "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                finish = choice.get("finish_reason") or finish
    return text, finish


def lora_report(stack) -> dict[str, worker_pb2.LoraAdapterLoad]:
    w = stack.workers("colocated")[0]
    with grpc.insecure_channel(w["grpc_addr"]) as ch:
        info = worker_pb2_grpc.WorkerIdentityStub(ch).GetWorkerInfo(worker_pb2.WorkerInfoRequest(), timeout=10,
                                                                    metadata=INTERNAL_METADATA)
    return {a.name: a for a in info.load.lora.adapters}


def test_lazy_load_runtime_load_unload_and_errors(stack, tiny_llama, adapters, tmp_path):
    base = str(tiny_llama)
    assert not lora_report(stack)["all8"].loaded          # known, not read until a request needs it
    assert complete(stack, "all8").status_code == 200
    assert lora_report(stack)["all8"].loaded
    metrics = urllib.request.urlopen(
        f"http://127.0.0.1:{stack.workers('colocated')[0]['metrics_port']}/metrics", timeout=5).read().decode()
    assert 'tandem:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics

    body = {"lora_name": "attn4", "lora_path": str(adapters["attn4"])}
    assert post(stack, "/v1/load_lora_adapter", body, headers={}).status_code == 401
    r = post(stack, "/v1/load_lora_adapter", body)
    assert r.status_code == 200, r.text
    assert models(stack)["attn4"] == base
    engine = LLMEngine(EngineConfig(model=base, dtype="float32", page_size=4, max_total_tokens=2048, enable_lora=True,
                                    lora_modules=(("attn4", str(adapters["attn4"])),)))
    want = engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), loras=["attn4"])
    got = complete(stack, "attn4")
    assert got.status_code == 200 and got.json()["choices"][0]["text"] == want[0].text

    assert post(stack, "/v1/load_lora_adapter", body).status_code == 400            # already loaded
    bad = _copy(adapters["all8"], tmp_path / "bad", r=4)
    r = post(stack, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(bad)})
    assert r.status_code == 400 and "do not fit rank 4" in r.json()["error"]["message"], r.text
    r = post(stack, "/v1/load_lora_adapter", {"lora_name": "bad"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert "bad" not in models(stack)
    r = post(stack, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 404, r.text

    r = post(stack, "/v1/unload_lora_adapter", {"lora_name": "attn4"})
    assert r.status_code == 200, r.text
    assert "attn4" not in models(stack)
    assert complete(stack, "attn4").status_code == 404


def test_loads_and_unloads_while_requests_stream_lose_none(stack, adapters):
    names = ["all8", "", "all8", ""]   # "" : the base model (the only model besides the adapters)
    base = next(m for m, parent in models(stack).items() if parent is None)
    names = [n or base for n in names]
    alone = {n: stream(stack, n, 160) for n in set(names)}
    results: list = [None] * len(names)

    def run(i: int) -> None:
        results[i] = stream(stack, names[i], 160)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(names))]
    for t in threads:
        t.start()
    for name in ("mlp16", "attn4"):   # max-cpu-loras 2: each load evicts the idle one, never all8
        r = post(stack, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapters[name])})
        assert r.status_code == 200, r.text
    r = post(stack, "/v1/unload_lora_adapter", {"lora_name": "mlp16"})
    assert r.status_code == 200, r.text
    for t in threads:
        t.join(120)
    assert results == [alone[n] for n in names]
    assert all(finish == "length" for _, finish in results)
    assert post(stack, "/v1/unload_lora_adapter", {"lora_name": "attn4"}).status_code == 200


def test_unloading_an_adapter_in_use_is_refused_until_its_requests_finish(stack):
    with httpx.stream("POST", f"{stack.gateway_url}/v1/completions", headers=AUTH, timeout=120, json={
            "model": "all8", "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        lines = r.iter_lines()   # kept: a dropped iterator closes the stream (the request is cancelled)
        next(lines)                                        # it is running on the worker
        refused = post(stack, "/v1/unload_lora_adapter", {"lora_name": "all8"})
    assert refused.status_code == 409 and "in flight" in refused.json()["error"]["message"], refused.text
    deadline = time.monotonic() + 30
    while (r := post(stack, "/v1/unload_lora_adapter", {"lora_name": "all8"})).status_code == 409:
        assert time.monotonic() < deadline, "the cancelled request kept the adapter in use"
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    assert "all8" not in models(stack)


# The next two start a stack each: `make test-slow` (CI runs them). In `make test`: the runtime load and
# unload above, 1P1D with adapters (tests/e2e/test_lora.py), a room whose workers differ
# (tests/services/test_pd_workers.py) and LoRA-aware routing (tests/services/router/test_lora_routing.py).
@pytest.mark.slow
def test_a_runtime_load_reaches_both_workers_of_a_disaggregated_pair(tiny_llama, adapters):
    # P and D both load it (the router calls every worker); P's bootstrap check of D's digest passes.
    s = Stack("--mode", "disagg", "--model", str(tiny_llama), *ENGINE, "--enable-lora",
              "--enable-lora-runtime-updating", "--api-key", KEY, gateway=True)
    try:
        assert complete(s, "attn4").status_code == 404
        r = post(s, "/v1/load_lora_adapter", {"lora_name": "attn4", "lora_path": str(adapters["attn4"])})
        assert r.status_code == 200, r.text
        engine = LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32", page_size=4, max_total_tokens=2048,
                                        enable_lora=True, lora_modules=(("attn4", str(adapters["attn4"])),)))
        want = engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                               loras=["attn4"])[0].text
        got = complete(s, "attn4")
        assert got.status_code == 200 and got.json()["choices"][0]["text"] == want, got.text
        assert post(s, "/v1/unload_lora_adapter", {"lora_name": "attn4"}).status_code == 200
        assert complete(s, "attn4").status_code == 404
    finally:
        s.close()


@pytest.mark.slow
def test_the_router_sends_an_adapter_to_the_worker_that_has_it_loaded(tiny_llama, adapters):
    from tandem.v1 import generation_pb2, generation_pb2_grpc

    s = Stack("--mode", "colocated", "--colocated", "2", "--policy", "least_load", "--model", str(tiny_llama),
              *ENGINE, "--enable-lora", "--lora-modules", f"all8={adapters['all8']}", "--api-key", KEY, gateway=True)
    try:
        first, last = sorted(s.workers("colocated"), key=lambda w: w["worker_id"])
        # all8 read on the last worker only (a request straight to it); least_load's tie-break is the first.
        with grpc.insecure_channel(last["grpc_addr"]) as ch:
            req = generation_pb2.GenerateRequest(model="all8", token_ids=generation_pb2.TokenIds(ids=PROMPT),
                                                 sampling=generation_pb2.SamplingParams(max_tokens=2))
            list(generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=30, metadata=INTERNAL_METADATA))
        time.sleep(4.0)    # its load report (heartbeat 1 s) reaches the router (poll 0.5 s)
        before = {w["worker_id"]: s.worker_requests(w).get("success", 0) for w in (first, last)}
        for i in range(3):
            for model in ("all8", str(tiny_llama)):
                r = post(s, "/v1/completions", {"model": model, "prompt": [7 + i, *PROMPT], "max_tokens": 2})
                assert r.status_code == 200, r.text
        after = {w["worker_id"]: s.worker_requests(w).get("success", 0) for w in (first, last)}
        assert after[last["worker_id"]] - before[last["worker_id"]] == 3     # every all8 request
        assert after[first["worker_id"]] - before[first["worker_id"]] == 3   # every base request
    finally:
        s.close()
