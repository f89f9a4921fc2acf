"""Is there a GPU here, and what is it: name, memory, versions and peak memory bandwidth.

"No GPU" must not hide a broken one: when the machine shows an NVIDIA device (a /dev/nvidia* node,
the driver's /proc entry, nvidia-smi) but torch sees no CUDA device, the check fails instead of
saying there is nothing to check.
"""

from __future__ import annotations

import glob
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Probe:
    cuda: bool                 # torch sees a CUDA device
    signs: tuple[str, ...]     # what says this machine has an NVIDIA GPU, whatever torch sees
    torch: str
    reason: str = ""           # why torch sees none


def nvidia_signs() -> tuple[str, ...]:
    signs = []
    if glob.glob("/dev/nvidia[0-9]*"):
        signs.append("/dev/nvidia* device nodes")
    if os.path.exists("/proc/driver/nvidia/version"):
        signs.append("/proc/driver/nvidia")
    if shutil.which("nvidia-smi"):
        signs.append("nvidia-smi on PATH")
    return tuple(signs)


def probe() -> Probe:
    import torch

    reason = ""
    try:
        cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception as e:     # a broken driver can raise here
        cuda, reason = False, f"{type(e).__name__}: {e}"
    if not cuda and not reason:
        reason = ("torch was built without CUDA" if torch.version.cuda is None
                  else f"torch (CUDA {torch.version.cuda}) finds no CUDA device")
    return Probe(cuda=cuda, signs=nvidia_signs(), torch=torch.__version__, reason=reason)


def datasheet_gbps(name: str) -> float | None:
    from tandem.bench.kernels import peak_gbps

    return peak_gbps(name)


def device_peak_gbps(index: int = 0) -> tuple[float | None, str]:
    """Peak DRAM bandwidth from the device itself: memory clock x bus width x 2 (double data rate).
    CUDA's device properties where torch exposes them, else NVML; (None, why) when neither does."""
    import torch

    props = torch.cuda.get_device_properties(index)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return round(2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, 1), \
            f"CUDA device properties: {clock_khz / 1e3:.0f} MHz x {bus_bits} bit x 2"
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            # NVML's index order can differ from CUDA's: find the device by its PCI address.
            pci = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
            try:
                assert all(isinstance(x, int) for x in pci)
                handle = pynvml.nvmlDeviceGetHandleByPciBusId(f"{pci[0]:08x}:{pci[1]:02x}:{pci[2]:02x}.0")
            except Exception:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            clock_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
            bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
        finally:
            pynvml.nvmlShutdown()
        return round(2 * clock_mhz * 1e6 * bus_bits / 8 / 1e9, 1), f"NVML: {clock_mhz} MHz x {bus_bits} bit x 2"
    except Exception as e:
        return None, f"neither CUDA's device properties nor NVML gave it ({type(e).__name__}: {e})"


def describe(index: int = 0) -> dict:
    """The machine as the run's JSON records it."""
    import torch
    import triton

    props = torch.cuda.get_device_properties(index)
    peak, how = device_peak_gbps(index)
    return {
        "gpu": props.name, "capability": list(torch.cuda.get_device_capability(index)),
        "memory_gib": round(props.total_memory / (1 << 30), 1), "sms": props.multi_processor_count,
        "driver": _driver_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "triton": triton.__version__, "python": platform.python_version(),
        "peak_gbps_device": peak, "peak_gbps_device_how": how, "peak_gbps_datasheet": datasheet_gbps(props.name),
    }


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None
