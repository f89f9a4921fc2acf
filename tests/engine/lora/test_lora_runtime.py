"""Adapters known vs loaded on the engine: loaded when a request first needs one, at most
--max-cpu-loras of them (least recently used idle one out), loaded and unloaded at runtime; the
output of an adapter reloaded after an eviction is the same as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.engine.errors import Conflict, InvalidRequest, ModelNotFound, ResourceExhausted
from tandem.engine.sampling_params import SamplingParams
from tests.engine.lora.test_lora_engine import ADAPTERS, _copy, engine_with, make_adapter

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = [5, 9, 17, 3, 12, 8]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {name: make_adapter(tiny_llama, root / name, *spec, seed=i) for i, (name, spec) in enumerate(ADAPTERS.items())}


def run(engine, lora):
    return engine.generate([PROMPT], GREEDY, loras=[lora])[0].token_ids


def test_lazy_load_lru_eviction_and_reload_give_the_same_tokens(tiny_llama, adapters):
    engine = engine_with(tiny_llama, adapters, max_loras=2, max_cpu_loras=2)
    assert set(engine.loras.known) == set(adapters) and not engine.loras.adapters   # nothing read yet
    first = {n: run(engine, n) for n in ("all8", "attn4")}
    assert set(engine.loras.adapters) == {"all8", "attn4"} and engine.runner.lora_stack is not None
    run(engine, "all8")                              # attn4 is now the least recently used
    mlp = run(engine, "mlp16")
    assert set(engine.loras.adapters) == {"all8", "mlp16"}
    assert set(engine.runner.lora_stack.index) == {"all8", "mlp16"}   # the stack follows the loaded set
    assert run(engine, "attn4") == first["attn4"]    # read again from disk: the same adapter
    assert set(engine.loras.adapters) == {"mlp16", "attn4"}
    assert len({tuple(first["all8"]), tuple(first["attn4"]), tuple(mlp)}) == 3
    engine.check_idle()


def test_loads_and_evictions_are_counted(tiny_llama, adapters, tmp_path):
    # What tandem_lora_loads_total / tandem_lora_evictions_total export (services/worker/lora_report.py).
    bad = _copy(adapters["all8"], tmp_path / "bad", r=4)
    engine = engine_with(tiny_llama, {**adapters, "bad": bad}, max_loras=2, max_cpu_loras=2,
                         enable_lora_runtime_updating=True)
    loras = engine.loras
    assert (loras.loads, loras.evictions) == (0, 0)             # lazy: nothing read at start
    for name in ("all8", "attn4", "all8", "mlp16"):             # 3 adapters through 2 slots
        run(engine, name)
    assert (loras.loads, loras.evictions) == (3, 1)             # attn4 out; all8 again was loaded already
    run(engine, "attn4")                                        # read again: all8 out
    assert (loras.loads, loras.evictions) == (4, 2)
    with pytest.raises(InvalidRequest):                         # a file that fails to load: nothing counted,
        engine.add_request(PROMPT, GREEDY, lora="bad")          # nothing dropped
    assert (loras.loads, loras.evictions) == (4, 2) and set(loras.adapters) == {"mlp16", "attn4"}
    engine.unload_lora("attn4")                                 # an unload is not an eviction
    assert (loras.loads, loras.evictions) == (4, 2)
    eager = engine_with(tiny_llama, adapters, max_loras=1, max_cpu_loras=3, lora_eager_load=True)
    assert (eager.loras.loads, eager.loras.evictions) == (3, 0)   # read at start
    engine.check_idle()


def test_an_adapter_in_use_is_never_evicted(tiny_llama, adapters):
    engine = engine_with(tiny_llama, adapters, max_loras=1, max_cpu_loras=1)
    engine.add_request(PROMPT, GREEDY, lora="all8")
    with pytest.raises(ResourceExhausted, match="in flight"):
        engine.add_request(PROMPT, GREEDY, lora="attn4")
    assert set(engine.loras.adapters) == {"all8"}
    while engine.has_work():
        engine.step()
    engine.add_request(PROMPT, GREEDY, lora="attn4")  # all8 idle now: it makes room
    while engine.has_work():
        engine.step()
    assert set(engine.loras.adapters) == {"attn4"}
    engine.check_idle()


def test_runtime_load_and_unload(tiny_llama, adapters, tmp_path):
    engine = engine_with(tiny_llama, {"all8": adapters["all8"]}, max_loras=2, max_cpu_loras=2,
                         enable_lora_runtime_updating=True)
    before = run(engine, "all8")
    engine.load_lora("attn4", str(adapters["attn4"]))
    assert "attn4" in engine.loras.adapters and engine.lora_for("attn4") == "attn4"
    with pytest.raises(InvalidRequest, match="already loaded"):
        engine.load_lora("attn4", str(adapters["attn4"]))
    bad = _copy(adapters["all8"], tmp_path / "bad", r=4)
    with pytest.raises(InvalidRequest, match="do not fit rank 4"):
        engine.load_lora("bad", str(bad))
    assert "bad" not in engine.loras.known and set(engine.loras.adapters) == {"all8", "attn4"}
    engine.add_request(PROMPT, GREEDY, lora="attn4")
    with pytest.raises(Conflict, match="in flight"):    # refused, not waited for
        engine.unload_lora("attn4")
    while engine.has_work():
        engine.step()
    engine.unload_lora("attn4")
    assert engine.lora_for("attn4") is None and set(engine.loras.adapters) == {"all8"}
    with pytest.raises(ModelNotFound):
        engine.unload_lora("attn4")
    with pytest.raises(InvalidRequest, match="no LoRA adapter 'attn4'"):
        engine.add_request(PROMPT, GREEDY, lora="attn4")
    assert run(engine, "all8") == before
    engine.check_idle()


def test_a_lazy_adapter_with_bad_weights_fails_its_request_not_the_start(tiny_llama, adapters, tmp_path):
    bad = _copy(adapters["all8"], tmp_path / "bad", r=4)
    engine = engine_with(tiny_llama, {"bad": bad, "all8": adapters["all8"]})
    with pytest.raises(InvalidRequest, match="'bad'.*do not fit rank 4"):
        engine.add_request(PROMPT, GREEDY, lora="bad")
    assert run(engine, "all8")
    engine.check_idle()
