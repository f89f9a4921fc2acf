"""Tandem: disaggregated prefill/decode LLM serving, one import namespace.

The source tree keeps the architecture's top-level folders; installed, each is a subpackage here
(pyproject.toml / setup.py map them), so nothing of Tandem's takes a top-level import name that
another distribution may own (Hugging Face's `kernels` is a real one):

    tandem.engine      engine/       model, KV pool and caches, scheduler, runners
    tandem.services    services/     prefill, decode, router, gateway, planner, launcher
    tandem.kvtransfer  kvtransfer/   transfer engines (shm, tcp, nixl, ucx) and their protocol
    tandem.kernels     kernels/      Triton kernels and the fused CPU kernels
    tandem.bench       bench/        load-test harness and benchmarks

and the rooms that live in this folder: `tandem.cli` (the `tandem` command), `tandem.v1` (the
generated gRPC/protobuf stubs, `make proto`: the wire contract) and `tandem.kvblocks` (KV block keys
and the KV-event format: the contract between workers and the router).
"""

import importlib.util
from pathlib import Path

# A source checkout run without an install (the GPU machine runs the tree it is sent, as it lies):
# the folders above are found here, the same mapping as an install's. An install (editable or not)
# finds tandem.engine itself, and then this changes nothing. Only this package's own search path is
# touched: the checkout's root never goes on sys.path, where kernels/ would shadow the real `kernels`.
if importlib.util.find_spec(f"{__name__}.engine") is None:
    __path__.append(str(Path(__file__).resolve().parent.parent))
