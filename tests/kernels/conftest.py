"""Kernel tests run on the GPU when there is one, else on CPU under the Triton interpreter; the CPU
kernels' tests run on every ISA variant this CPU can run (`ops`).

TRITON_INTERPRET is read when a kernel is decorated, i.e. when a kernel module is first imported:
this conftest is imported before the test modules of this folder, so it sets it first.
"""

import os

import pytest
import torch

from tandem.kernels.cpu import load, runnable_levels

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module", params=runnable_levels())
def ops(request):
    """The CPU kernels (kernels/cpu) of each ISA level this CPU runs, one after the other."""
    ops = load(request.param)
    assert ops is not None, f"the {request.param} CPU kernels did not build (run `python -m tandem.kernels.cpu -v`)"
    assert ops.LEVEL == request.param
    return ops
