"""LoRA adapters served through the stack (`tandem up --enable-lora --lora-modules ...`): /v1/models lists
each adapter with its parent; a request picks one by `model`; greedy tokens equal the engine's
(co-located) and co-located equals 1P1D (both workers apply the adapter); an unknown adapter is a 404."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tests.e2e.stack import Stack
from tests.engine.lora.test_lora_engine import ADAPTERS, make_adapter

pytestmark = pytest.mark.timeout(600)

ENGINE = ("--dtype", "float32", "--page-size", "4", "--max-total-tokens", "2048")
PROMPTS = [[5, 9, 17, 3, 12], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7] * 13]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {name: make_adapter(tiny_llama, root / name, *spec, seed=i) for i, (name, spec) in enumerate(ADAPTERS.items())}


def lora_args(adapters) -> list[str]:
    return ["--enable-lora", *[x for n, p in adapters.items() for x in ("--lora-modules", f"{n}={p}")]]


def completions(url: str, model: str) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


@pytest.fixture(scope="module")
def reference(tiny_llama, adapters) -> dict[str, list[str]]:
    """Each adapter's (and the base model's) greedy text from the engine in this process."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32", page_size=4, max_total_tokens=2048,
                                    enable_lora=True, lora_modules=tuple((n, str(p)) for n, p in adapters.items())))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = {}
    for name in (None, *adapters):
        out[name or "base"] = [r.text for r in engine.generate(PROMPTS, params, loras=[name] * len(PROMPTS))]
    assert len({tuple(v) for v in out.values()}) == len(out), "the adapters must change the text"
    return out


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_adapters_are_listed_picked_by_model_and_equal_the_engine(tiny_llama, adapters, reference, mode):
    stack = Stack("--mode", mode, "--model", str(tiny_llama), *ENGINE, *lora_args(adapters), gateway=True)
    try:
        url = stack.gateway_url
        cards = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
        base = str(tiny_llama)
        assert cards[base]["parent"] is None
        assert {n: cards[n]["parent"] for n in adapters} == dict.fromkeys(adapters, base)
        for name in adapters:
            assert completions(url, name) == reference[name], name
        assert completions(url, base) == reference["base"]
        r = httpx.post(f"{url}/v1/completions", timeout=30, json={"model": "nope", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    finally:
        stack.close()


def test_a_bad_adapter_stops_the_worker_at_start_saying_why(tiny_llama, adapters, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "use_dora": true}')
    with pytest.raises(RuntimeError, match="DoRA"):
        Stack("--mode", "colocated", "--model", str(tiny_llama), *ENGINE, "--enable-lora", "--lora-modules",
              f"bad={bad}", timeout_s=120).close()


def test_config_refuses_lora_modules_without_enable_lora():
    from tandem.engine.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="needs --enable-lora"):
        dataclasses.replace(EngineConfig(), lora_modules=(("a", "/x"),)).validate()
