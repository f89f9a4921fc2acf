"""engine/hardware.py: the hardware-dependent defaults per CPU class and GPU."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tandem.engine.hardware import (
    Choice,
    Hardware,
    choose_cpu_kernels,
    choose_dtype,
    choose_extend_attention,
    choose_graphs,
    choose_kv_layout,
    choose_overlap,
    choose_weight_prepack,
    detect,
    resolve_dtype,
)

AVX2 = Hardware("cpu", "AMD EPYC (Zen 3)", cores=2, isa="avx2", host_isa="avx2")
AVX512 = Hardware("cpu", "Xeon (Skylake-SP)", cores=2, isa="avx512", host_isa="avx512", onednn_bf16=True)
ZEN4 = Hardware("cpu", "AMD EPYC (Zen 4)", cores=2, isa="avx512_bf16", host_isa="avx512_bf16",
                native_bf16=True, onednn_bf16=True)
ZEN4_AS_AVX2 = Hardware("cpu", "AMD EPYC (Zen 4)", cores=2, isa="avx2", host_isa="avx512_bf16",
                        isa_caps={"ATEN_CPU_CAPABILITY": "avx2"})
EMERALD_RAPIDS = Hardware("cpu", "Intel Xeon (Emerald Rapids)", cores=2, isa="avx512_bf16", host_isa="avx512_bf16",
                          native_bf16=True, onednn_bf16=True, amx=True)
GRAVITON3 = Hardware("cpu", "Neoverse-V1", cores=2, native_bf16=True, onednn_bf16=True)
A100 = Hardware("cuda", "A100", native_bf16=True, cuda_capability=(8, 0))
V100 = Hardware("cuda", "V100", cuda_capability=(7, 0))


@pytest.mark.parametrize("hw, model_dtype, want", [
    (AVX2, "float32", torch.float32),
    (AVX2, "bfloat16", torch.float32),        # a bf16 checkpoint still computes in fp32 there
    (AVX2, "float16", torch.float32),
    (AVX512, "bfloat16", torch.float32),      # AVX-512 without BF16: oneDNN emulates bf16
    (ZEN4_AS_AVX2, "bfloat16", torch.float32),
    (ZEN4, "float32", torch.bfloat16),
    (ZEN4, "float16", torch.bfloat16),        # fp16 matmuls are slow on CPUs
    (GRAVITON3, "bfloat16", torch.bfloat16),
    (A100, "float32", torch.bfloat16),
    (A100, "float16", torch.float16),
    (V100, "bfloat16", torch.float16),
])
def test_auto_dtype_per_device(hw, model_dtype, want):
    choice = choose_dtype(hw, model_dtype)
    assert choice.value == want
    assert choice.reason


def test_explicit_dtype_wins():
    assert resolve_dtype("bfloat16", AVX2).value == torch.bfloat16
    assert resolve_dtype("float32", ZEN4).value == torch.float32
    assert resolve_dtype("auto", AVX2).value == torch.float32


def test_other_defaults_per_device():
    assert choose_weight_prepack(ZEN4, torch.bfloat16, graphs=False).value
    assert not choose_weight_prepack(ZEN4, torch.bfloat16, graphs=True).value
    assert not choose_weight_prepack(ZEN4, torch.float32, graphs=False).value     # the CPU kernels are off
    assert choose_weight_prepack(AVX2, torch.float32, graphs=False, cpu_kernels=True).value   # their linear kernel
    assert not choose_weight_prepack(AVX2, torch.float32, graphs=True, cpu_kernels=True).value
    assert not choose_weight_prepack(A100, torch.float32, graphs=False, cpu_kernels=True).value
    assert not choose_weight_prepack(AVX2, torch.bfloat16, graphs=False).value   # oneDNN has no bf16 there
    assert choose_cpu_kernels(AVX2, graphs=False).value and "avx2" in choose_cpu_kernels(AVX2, False).reason
    assert not choose_cpu_kernels(AVX2, graphs=True).value
    assert not choose_cpu_kernels(A100, graphs=False).value
    assert not choose_graphs("cpu").value and choose_graphs("cuda").value
    assert not choose_overlap("cpu").value and choose_overlap("cuda").value


def test_extend_attention_is_sdpa_only_for_bf16_on_amx():
    assert choose_extend_attention(EMERALD_RAPIDS, torch.bfloat16).value == "sdpa"
    assert choose_extend_attention(EMERALD_RAPIDS, torch.float32).value == "kernel"
    for hw in (ZEN4, AVX2, AVX512, ZEN4_AS_AVX2, GRAVITON3):
        assert choose_extend_attention(hw, torch.bfloat16).value == "kernel", hw.name
    assert choose_extend_attention(A100, torch.bfloat16).value == "kernel"      # not ours to decide there
    assert "AMX" in EMERALD_RAPIDS.summary() and "AMX" not in ZEN4.summary()


def test_summary_says_what_was_capped():
    assert "capped from avx512_bf16 by ATEN_CPU_CAPABILITY" in ZEN4_AS_AVX2.summary()
    assert "no native bf16" in AVX2.summary() and "native bf16" in ZEN4.summary()


_PROBE = ("import json, torch; from tandem.engine.hardware import detect, choose_dtype; hw = detect('cpu'); "
          "print(json.dumps({'isa': hw.isa, 'native_bf16': hw.native_bf16, 'onednn_bf16': hw.onednn_bf16, "
          "'dtype': str(choose_dtype(hw).value), 'aten': torch.backends.cpu.get_cpu_capability()}))")


def _probe(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_emulated_avx2_machine_is_detected_as_one():
    """What CI's second engine run relies on: under the emulation variables torch, oneDNN and the
    hardware module all see an AVX2-only CPU, and `auto` picks fp32."""
    base = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    got = _probe({**base, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert got == {"isa": "avx2", "native_bf16": False, "onednn_bf16": False, "dtype": "torch.float32",
                   "aten": "AVX2"}


def test_this_machine_is_consistent():
    hw = detect("cpu")
    assert (choose_dtype(hw).value == torch.bfloat16) == hw.native_bf16
    assert not hw.native_bf16 or hw.onednn_bf16


@pytest.mark.skipif(not os.environ.get("TANDEM_EXPECT_ISA"), reason="only in `make test-avx2`")
def test_the_emulated_isa_is_in_force():
    """`make test-avx2` sets TANDEM_EXPECT_ISA beside the caps: a suite that believes it tests an
    AVX2-only CPU but runs at full ISA (a cap misspelt, a variable torch stopped reading) fails here."""
    want = os.environ["TANDEM_EXPECT_ISA"]
    hw = detect("cpu")
    assert hw.isa == want, hw
    if want == "avx2":
        assert torch.backends.cpu.get_cpu_capability() == "AVX2"
        assert not hw.onednn_bf16 and not hw.native_bf16


def test_kv_layout_is_layer_first_on_every_cpu_and_page_first_on_gpus():
    for hw in (AVX2, AVX512, ZEN4, ZEN4_AS_AVX2, GRAVITON3):
        assert choose_kv_layout("auto", hw).value == "layer_first", hw.name
    for hw in (A100, V100):
        assert choose_kv_layout("auto", hw).value == "page_first", hw.name
    assert choose_kv_layout("page_first", AVX2) == Choice("page_first", "--kv-layout")
