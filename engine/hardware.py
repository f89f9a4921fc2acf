"""What this device can do fast, and every default that depends on it.

One place decides the hardware-dependent defaults — dtype, weight prepacking, the fused CPU kernels
and their ISA variant, decode graphs, overlap scheduling — and says why, so that the banner, the
logs and the tests all read the same decision. A flag the user set always wins; these are only the
`auto` / unset answers.

Why the dtype depends on the CPU (measured, docs/benchmarks.md "Engine" and bench/dtype_choice.py):
a bf16 matmul is fast only where the CPU multiplies bf16 natively (AVX512-BF16 or AMX on x86, the
BF16 extension on Arm). Elsewhere oneDNN and MKL convert to fp32 and back: on an AVX2-only machine
a bf16 projection ran 3.6 GFLOP/s against 21 in fp32 (6x slower), prefill served 24-34 tokens/s and
a 1,000-token prompt took over 30 s. Storing weights in bf16 and computing in fp32 halves the bytes a
decode step reads but converts every weight on every step (1.7x faster than fp32 at one decode row,
slower from 32 rows and 1.5x slower in prefill), and torch's weight-only int8 matmul has no fast
AVX2 path (2-40x slower than fp32). So: bf16 where it is native, fp32 elsewhere.

What does not depend on the CPU class: the mixed-chunk bounds are fitted to measured step times on
the machine itself (engine/scheduler/step_cost.py), and torch's thread count defaults to the cores
this process may run on (`tandem up` splits them between workers).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.kernels.cpu import isa


@dataclass(frozen=True)
class Hardware:
    """Facts about one device, read once (`detect`)."""

    device: str                              # "cpu" | "cuda"
    name: str                                # CPU model name / GPU name
    cores: int = 1                           # CPUs this process may run on
    isa: str = "generic"                     # CPU: effective kernels.cpu.isa level (after emulation caps)
    host_isa: str = "generic"                # CPU: the level the CPU itself has
    isa_caps: dict[str, str] = field(default_factory=dict)   # ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA in force
    native_bf16: bool = False                # bf16 matmuls run natively (not converted through fp32)
    onednn_bf16: bool = False                # oneDNN takes bf16 here (prepacked bf16 weights possible)
    amx: bool = False                        # oneDNN's bf16 GEMMs run on AMX tiles (kernels.cpu.isa.amx)
    cuda_capability: tuple[int, int] | None = None

    @property
    def is_cpu(self) -> bool:
        return self.device == "cpu"

    def summary(self) -> str:
        if not self.is_cpu:
            cc = ".".join(map(str, self.cuda_capability or ()))
            return f"{self.name} (CUDA {cc}{', native bf16' if self.native_bf16 else ''})"
        isa_text = self.isa if self.isa == self.host_isa else f"{self.isa}, capped from {self.host_isa} by " + \
            " and ".join(sorted(self.isa_caps))
        bf16 = ("native bf16, AMX" if self.amx else "native bf16") if self.native_bf16 else "no native bf16"
        return f"{self.name}, {self.cores} core{'s' if self.cores != 1 else ''} ({isa_text}; {bf16})"


@dataclass(frozen=True)
class Choice:
    """A default taken for this device, with the reason a person reads in the logs."""

    value: object
    reason: str


def detect(device: torch.device | str = "cpu") -> Hardware:
    """This process's view of `device` (cached per device type)."""
    dev = torch.device(device)
    return _detect_cuda(dev.index or 0) if dev.type == "cuda" else _detect_cpu()


@functools.cache
def _detect_cpu() -> Hardware:
    flags = isa.cpu_flags()
    host = isa.host_level(flags)
    caps = isa.caps()
    level = isa.effective_level(flags=flags)
    onednn_bf16 = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if isa.is_x86():
        # AVX512-BF16 (or AMX, which comes with it): bf16 dot products in hardware. oneDNN without
        # them (AVX-512 alone) emulates bf16 through fp32 conversions.
        hw_bf16 = level == "avx512_bf16"
    else:
        hw_bf16 = "bf16" in flags         # Arm: FEAT_BF16 (Neoverse V1/N2, Graviton 3+)
    return Hardware(device="cpu", name=_cpu_name(), cores=_cores(), isa=level, host_isa=host, isa_caps=caps,
                    native_bf16=hw_bf16 and onednn_bf16, onednn_bf16=onednn_bf16,
                    amx=onednn_bf16 and isa.amx(flags=flags))


@functools.cache
def _detect_cuda(index: int) -> Hardware:
    cap = torch.cuda.get_device_capability(index)
    return Hardware(device="cuda", name=torch.cuda.get_device_name(index), cuda_capability=cap,
                    native_bf16=cap >= (8, 0))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


# --- the defaults ------------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def choose_dtype(hw: Hardware, model_dtype: str = "float32") -> Choice:
    """`--dtype auto`: the model's half-precision dtype where this device computes it natively,
    else fp32. `model_dtype` is the checkpoint's `torch_dtype` (fp32-only checkpoints are served in
    half precision too where that is native: half the memory traffic, same answers within rounding)."""
    if not hw.is_cpu:
        if hw.native_bf16:
            if model_dtype == "float16":
                return Choice(torch.float16, "the checkpoint is float16")
            return Choice(torch.bfloat16, "bf16 is native on this GPU")
        return Choice(torch.float16, "this GPU has no native bf16 (compute capability < 8.0)")
    if hw.native_bf16:
        return Choice(torch.bfloat16, "this CPU multiplies bf16 natively")
    where = "this CPU" if hw.host_isa == hw.isa else "the capped ISA"
    return Choice(torch.float32, f"no native bf16 on {where} ({hw.isa}): bf16 matmuls would convert "
                                 "through fp32, 3-6x slower")


def resolve_dtype(name: str, hw: Hardware, model_dtype: str = "float32") -> Choice:
    if name != "auto":
        return Choice(_DTYPES[name], "--dtype")
    return choose_dtype(hw, model_dtype)


def choose_weight_prepack(hw: Hardware, dtype: torch.dtype, graphs: bool, cpu_kernels: bool = False) -> Choice:
    """Linears on weights packed once at load time (engine/models/prepack.py): bf16 in oneDNN's layout,
    fp32 in the panel layout of Tandem's linear kernel (kernels/cpu/linear.cpp; `cpu_kernels`: they
    are loaded)."""
    if not hw.is_cpu or dtype not in (torch.bfloat16, torch.float32):
        return Choice(False, "only bf16 and fp32 on CPU")
    if dtype == torch.bfloat16 and not hw.onednn_bf16:
        return Choice(False, "oneDNN has no bf16 on this CPU")
    if dtype == torch.float32 and not cpu_kernels:
        return Choice(False, "fp32 packs for Tandem's CPU linear kernel, and the CPU kernels are off")
    if graphs:
        return Choice(False, "decode graphs manage their own weights")
    if dtype == torch.float32:
        return Choice(True, "fp32 through Tandem's CPU linear kernel: MKL/oneDNN waste most of a core at "
                            "decode batch sizes")
    return Choice(True, "bf16 on a CPU whose oneDNN takes bf16")


def choose_kv_layout(name: str, hw: Hardware) -> Choice:
    """The KV pool's layout (engine/kvcache/kv_pool.py). Measured on CPU (docs/benchmarks.md, "KV layout"):
    page-first makes every transfer backend 1.2-3.8x faster, but decode 3-23% slower over a request's
    pages (allocated in runs), since each layer's page is then a short read far from the next
    and the prefetcher restarts at each; so layer-first on CPU, page-first on GPUs (where attention
    reads pages in parallel from HBM and transfers ride RDMA: vLLM's cross-layer blocks)."""
    if name != "auto":
        return Choice(name, "--kv-layout")
    if hw.is_cpu:
        return Choice("layer_first", "CPU decode attention reads a layer's pages in runs")
    return Choice("page_first", "one piece per page to transfer; attention reads pages in parallel")


def choose_extend_attention(hw: Hardware, dtype: torch.dtype) -> Choice:
    """What computes prefill/extend attention on CPU (engine/attention/torch_backend.py): Tandem's paged
    kernel (kernels/cpu/extend.cpp: bf16 pairs by `vdpbf16ps`, or fp32), or torch's flash attention in
    the pool's dtype, whose GEMMs are oneDNN's brgemm. Measured per layer, one core, bf16, SmolLM2's
    9/3 heads (docs/benchmarks.md, "CPU kernels"): on a Xeon with AMX bf16 SDPA was 2.5-4.8x the
    kernel (256 tokens 0.76 against 1.90 ms, 2,048 18.5 against 88.2); on Zen 4 (no AMX) torch's bf16
    SDPA ran its GEMMs at the fp32 rate and the kernel was 2.6-3.7x faster. So SDPA where AMX is."""
    if not hw.is_cpu:
        return Choice("kernel", "not a CPU: the attention backend decides")
    if dtype == torch.bfloat16 and hw.amx:
        return Choice("sdpa", "bf16 on AMX: torch's flash attention (oneDNN brgemm on AMX tiles) beats the kernel")
    return Choice("kernel", "Tandem's paged kernel (no AMX, or not bf16)")


def choose_cpu_kernels(hw: Hardware, graphs: bool) -> Choice:
    """Tandem's fused C++ kernels (kernels/cpu), in the variant of the effective ISA level."""
    if not hw.is_cpu:
        return Choice(False, "not a CPU")
    if graphs:
        return Choice(False, "decode graphs trace the torch code")
    return Choice(True, f"{hw.isa} variant")


def choose_graphs(device_type: str) -> Choice:
    if device_type == "cpu":
        return Choice(False, "on CPU eager with prepacked weights and fused kernels measured faster")
    return Choice(True, "CUDA graphs remove per-kernel launch costs")


def choose_overlap(device_type: str) -> Choice:
    if device_type == "cpu":
        return Choice(False, "the forward pass and the scheduler would share the same cores")
    return Choice(True, "the CPU plans the next step while the GPU runs this one")
