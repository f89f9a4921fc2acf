"""LoRA adapters in PEFT's format: greedy tokens of a batch that mixes three adapters and the base
model equal Hugging Face transformers + PEFT's, each prompt run alone there (fp32); adapters never
share KV (each caches in its own namespace); a bad adapter is refused at load, an unknown one per
request."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.errors import InvalidRequest
from tandem.engine.lora import registry
from tandem.engine.sampling_params import SamplingParams
from tests.engine.test_engine_vs_hf import hf_greedy, random_prompts

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, targets, rslora)
ADAPTERS = {"all8": (8, 16, ALL, False), "attn4": (4, 8, ["q_proj", "v_proj"], False),
            "mlp16": (16, 8, ["gate_proj", "up_proj", "down_proj"], True)}


def make_adapter(base: Path, out: Path, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int) -> Path:
    """A PEFT LoRA with random A and B (PEFT's default B = 0 would change nothing)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                  use_rslora=rslora, init_lora_weights=False))
    with torch.no_grad():   # big enough to change greedy tokens of the tiny model
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {name: make_adapter(tiny_llama, root / name, *spec, seed=i) for i, (name, spec) in enumerate(ADAPTERS.items())}


def engine_with(path, adapters: dict[str, Path], **kw) -> LLMEngine:
    base = EngineConfig(model=str(path), dtype="float32", page_size=4, max_total_tokens=2048, enable_lora=True,
                        lora_modules=tuple((n, str(p)) for n, p in adapters.items()), max_loras=4)
    return LLMEngine(dataclasses.replace(base, **kw))


def test_a_mixed_batch_of_adapters_and_the_base_model_equals_peft(tiny_llama, adapters):
    from peft import PeftModel

    engine = engine_with(tiny_llama, adapters)
    names = [None, "all8", "attn4", "mlp16"] * 2
    prompts = random_prompts([5, 9, 17, 3, 12, 7, 22, 30], engine.model_config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = engine.generate(prompts, params, loras=names)      # every loaded adapter in the step: stacked
    engine.check_idle()
    engine.runner.lora_stack = None                           # the same batch segmented, adapter by adapter
    assert [r.token_ids for r in engine.generate(prompts, params, loras=names)] == [r.token_ids for r in got]

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    base = [hf_greedy(hf, p, 8) for p in prompts]         # before PEFT wraps (and changes) the model
    peft = PeftModel.from_pretrained(hf, adapters["all8"], adapter_name="all8").eval()
    for name in ("attn4", "mlp16"):
        peft.load_adapter(adapters[name], adapter_name=name)
    refs = list(base)
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        if name is not None:
            peft.set_adapter(name)
            refs[i] = hf_greedy(peft, prompt, 8)
    assert [r.token_ids for r in got] == refs
    for name in ADAPTERS:     # every adapter changed some of its prompts' tokens: the test can tell them apart
        assert any(refs[i] != base[i] for i, n in enumerate(names) if n == name), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cpu_kernel_gives_the_tokens_of_the_torch_paths(tiny_llama, adapters, monkeypatch, dtype):
    """On CPU the adapters run on Tandem's CPU kernel (kernels/cpu/lora.cpp) where it is loaded: one
    adapter on every row, then a mixed batch, greedy, against the same engine on the torch paths."""
    kernel = engine_with(tiny_llama, adapters, dtype=dtype)
    monkeypatch.setattr(registry, "choose", lambda device, dtype, cpu_ops: "torch")
    plain = engine_with(tiny_llama, adapters, dtype=dtype)
    assert kernel.loras.path == "cpu" and plain.loras.path == "torch"
    prompts = random_prompts([5, 9, 17, 3, 12, 7, 22, 30], kernel.model_config.vocab_size, seed=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for names in (["all8"] * 8, [None, "all8", "attn4", "mlp16"] * 2):
        got = [r.token_ids for r in kernel.generate(prompts, params, loras=names)]
        assert kernel.runner.lora_stack.cpu_ops is not None       # a stack of one adapter too
        assert got == [r.token_ids for r in plain.generate(prompts, params, loras=names)], names
    kernel.check_idle()


def test_adapters_change_the_output_and_never_share_kv(tiny_llama, adapters):
    engine = engine_with(tiny_llama, adapters)
    prompt = random_prompts([24], engine.model_config.vocab_size, seed=5)[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    [base] = engine.generate([prompt], params)
    # The same prompt under an adapter right after: were its KV taken from the base model's cached
    # prefix, the tokens would differ from the adapter run on a fresh engine.
    [warm] = engine.generate([prompt], params, loras=["all8"])
    [cold] = engine_with(tiny_llama, adapters).generate([prompt], params, loras=["all8"])
    assert warm.token_ids == cold.token_ids != base.token_ids
    assert warm.usage.cached_tokens == 0
    [again] = engine.generate([prompt], params)              # the base model still hits its own cache
    assert again.token_ids == base.token_ids and again.usage.cached_tokens > 0
    [hit] = engine.generate([prompt], params, loras=["all8"])   # ... and the adapter its own
    assert hit.token_ids == warm.token_ids and hit.usage.cached_tokens > 0
    [other] = engine.generate([prompt], params, loras=["attn4"])  # another adapter: none of it
    assert other.usage.cached_tokens == 0
    engine.check_idle()


def test_an_unknown_adapter_is_refused_and_changes_nothing(tiny_llama, adapters):
    engine = engine_with(tiny_llama, adapters)
    with pytest.raises(InvalidRequest, match="no LoRA adapter 'nope'") as e:
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), lora="nope")
    assert e.value.param == "model"
    engine.check_idle()
    plain = dataclasses.replace(EngineConfig(model=str(tiny_llama), dtype="float32", max_total_tokens=512))
    with pytest.raises(InvalidRequest, match="LoRA is off"):
        LLMEngine(plain).add_request([5, 6], SamplingParams(max_tokens=2), lora="all8")


def _copy(src: Path, dst: Path, **config) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    return dst


@pytest.mark.parametrize(("config", "says"), [
    ({"use_dora": True}, "DoRA"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"), ({"r": 64}, "above --max-lora-rank"),
    ({"peft_type": "PREFIX_TUNING"}, "not a LoRA adapter"), ({"r": 4}, "do not fit rank 4"),
])
def test_a_bad_adapter_is_refused_at_load_saying_why(tiny_llama, adapters, tmp_path, config, says):
    bad = _copy(adapters["all8"], tmp_path / "bad", **config)
    with pytest.raises(InvalidRequest, match=says):   # eager: the weights are read at start
        engine_with(tiny_llama, {"bad": bad}, lora_eager_load=True)


def test_the_flags_are_checked():
    for kw, says in [({"lora_modules": (("a", "/x"),)}, "needs --enable-lora"),
                     ({"enable_lora": True, "max_loras": 4, "max_cpu_loras": 2}, "--max-cpu-loras"),
                     ({"enable_lora": True, "lora_modules": (("a", "/x"), ("a", "/y"))}, "twice")]:
        with pytest.raises(InvalidRequest, match=says):
            dataclasses.replace(EngineConfig(), **kw).validate()


def test_at_most_max_loras_adapters_are_in_flight(tiny_llama, adapters):
    engine = engine_with(tiny_llama, adapters, max_loras=2, max_cpu_loras=3)
    names = ["all8", "attn4", "mlp16", None, "all8"]
    prompts = random_prompts([6] * len(names), engine.model_config.vocab_size, seed=9)
    for p, n in zip(prompts, names, strict=True):
        engine.add_request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), lora=n)
    seen, done = 0, 0
    while engine.has_work():
        outs = engine.step()
        sched = engine.scheduler
        active = {r.lora.name for r in (*sched.running, *sched.prefilling) if r.lora is not None}
        assert len(active) <= 2, active
        seen = max(seen, len(active))
        done += sum(o.finished for o in outs)
    assert done == len(names) and seen == 2      # mlp16 waited for a slot among the adapters, then ran
    engine.check_idle()
