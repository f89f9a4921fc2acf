"""Kernel tests run on the GPU when there is one, else on CPU under the Triton interpreter.

TRITON_INTERPRET is read when a kernel is decorated, i.e. when a kernel module is first imported:
this conftest is imported before the test modules of this folder, so it sets it first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
