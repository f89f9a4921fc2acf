"""kernels/cpu/isa.py: the ISA level read off the CPU's flags and capped by the emulation variables."""

from tandem.kernels.cpu import isa

ZEN4 = frozenset("fpu sse2 avx f16c fma avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni".split())
ZEN3 = frozenset("fpu sse2 avx f16c fma avx2".split())
EMERALD_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16"}
SKYLAKE_SP = frozenset("fpu sse2 avx f16c fma avx2 avx512f avx512dq avx512bw avx512vl avx512cd".split())


def test_host_level_from_flags():
    assert isa.host_level(ZEN4, "x86_64") == "avx512_bf16"
    assert isa.host_level(SKYLAKE_SP, "x86_64") == "avx512"
    assert isa.host_level(ZEN3, "x86_64") == "avx2"
    assert isa.host_level(frozenset({"sse2", "avx"}), "x86_64") == "generic"
    assert isa.host_level(frozenset({"avx2"}), "x86_64") == "generic"     # AVX2 without FMA/F16C is not the level
    assert isa.host_level(ZEN4, "aarch64") == "generic"


def test_caps_follow_torch_and_onednn_variables():
    assert isa.effective_level({}, ZEN4, "x86_64") == "avx512_bf16"
    env = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    assert isa.effective_level(env, ZEN4, "x86_64") == "avx2"
    assert isa.caps(env) == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "avx2"}
    assert isa.effective_level({"ATEN_CPU_CAPABILITY": "avx2"}, ZEN4, "x86_64") == "avx2"
    assert isa.effective_level({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, ZEN4, "x86_64") == "avx512"
    assert isa.effective_level({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, ZEN4, "x86_64") == "avx512_bf16"
    # A cap above what the CPU has changes nothing; an unknown value is ignored, as torch ignores it.
    assert isa.effective_level({"ATEN_CPU_CAPABILITY": "avx512"}, ZEN3, "x86_64") == "avx2"
    assert isa.effective_level({"ATEN_CPU_CAPABILITY": "bogus"}, ZEN4, "x86_64") == "avx512_bf16"


def test_cpu_flags_parses_x86_and_arm():
    assert "avx2" in isa.cpu_flags("processor\t: 0\nflags\t\t: fpu avx2 fma\n")
    assert "bf16" in isa.cpu_flags("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert isa.cpu_flags("nothing here") == frozenset()


def test_levels_up_to():
    assert isa.levels_up_to("avx2") == ("generic", "avx2")
    assert isa.levels_up_to("avx512_bf16") == isa.LEVELS


def test_amx_needs_the_flags_and_a_cap_that_allows_it():
    assert isa.amx({}, EMERALD_RAPIDS, "x86_64")
    assert not isa.amx({}, ZEN4, "x86_64")                      # AVX512-BF16 without AMX
    assert not isa.amx({}, EMERALD_RAPIDS, "aarch64")
    assert isa.amx({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, EMERALD_RAPIDS, "x86_64")
    assert isa.amx({"ONEDNN_MAX_CPU_ISA": "ALL"}, EMERALD_RAPIDS, "x86_64")
    # Emulating a CPU without AMX: a oneDNN cap below it, or the whole level capped.
    assert not isa.amx({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, EMERALD_RAPIDS, "x86_64")
    assert not isa.amx({"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}, EMERALD_RAPIDS, "x86_64")
    assert not isa.amx({"ATEN_CPU_CAPABILITY": "avx2"}, EMERALD_RAPIDS, "x86_64")
