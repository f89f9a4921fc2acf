"""LoRA-aware routing: which workers serve an adapter, and which of them a request of it should go to.

A worker reports every adapter it knows in its load (`WorkerLoad.lora`: loaded or not, requests
running and waiting on each); an older worker only lists them in `WorkerInfo.lora_adapters`. Any of
them serves the adapter, but one that has it *loaded* starts the request without reading it from
disk (and may evict nothing). `lora_affinity` narrows a request's candidates before the policy picks:

- a base-model request: every candidate (LoRA plays no part);
- an adapter request: the *warm* workers — that report it loaded, or to which this router has a
  request of it in flight (it is loaded there by now, though the report may not say so yet) — unless
  even the least busy of them is much busier than the least busy candidate: the same imbalance rule
  as `cache_aware`'s (`--balance-abs-threshold` more requests and `--balance-rel-threshold` times as
  many). Then, as when no worker is warm, every candidate that can load it (a worker whose
  `--max-cpu-loras` loaded adapters all have requests would refuse the load), if any: a hot adapter
  spreads to idle workers instead of piling up on the ones that had it first.
With `--lora-routing blind` an adapter's request is picked among all of its candidates (every worker
that serves the adapter), as a base-model request is: the baseline that aware routing is measured against.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from tandem.kvblocks.keys import KEY_BYTES
from tandem.services.router.cost import Candidate
from tandem.services.router.route_config import RouteConfig
from tandem.v1 import worker_pb2


def served_adapters(w: worker_pb2.WorkerInfo) -> list[str]:
    """The adapters a worker serves (knows), by name."""
    if w.load.HasField("lora"):
        return [a.name for a in w.load.lora.adapters]
    return list(w.lora_adapters)


def adapter_of(model: str, workers: Iterable[worker_pb2.WorkerInfo]) -> str:
    """`model` when some worker serves it as an adapter, else "" (the base model, or unknown)."""
    return model if model and any(model in served_adapters(w) for w in workers) else ""


def has_loaded(w: worker_pb2.WorkerInfo, adapter: str) -> bool:
    if w.load.HasField("lora"):
        return any(a.name == adapter and a.loaded for a in w.load.lora.adapters)
    return adapter in w.lora_adapters   # an older worker loaded all of its adapters at start


def adapter_block_parent(w: worker_pb2.WorkerInfo, adapter: str) -> bytes | None:
    """The parent key of `adapter`'s first KV blocks in `w`'s KV events (its digest's first bytes, as
    engine/lora/adapters.py `cache_key`); None when `w` does not report it loaded with its digest."""
    for a in w.load.lora.adapters:
        if a.name == adapter and a.loaded and a.digest:
            try:
                return bytes.fromhex(a.digest)[:KEY_BYTES]
            except ValueError:
                return None
    return None


def can_load(w: worker_pb2.WorkerInfo) -> bool:
    """Whether `w` could load one more adapter now: a free slot, or a loaded adapter no request uses."""
    if not w.load.HasField("lora"):
        return True
    loaded = [a for a in w.load.lora.adapters if a.loaded]
    return len(loaded) < w.load.lora.max_cpu_loras or any(not (a.running or a.waiting) for a in loaded)


def lora_affinity(adapter: str, candidates: Sequence[Candidate], cfg: RouteConfig,
                  routed: Callable[[str], bool] = lambda worker_id: False) -> Sequence[Candidate]:
    """The candidates a request of `adapter` ("" for the base model) should be picked from (non-empty
    when `candidates` is). `routed(worker_id)`: this router has a request of `adapter` in flight there."""
    if not adapter or cfg.lora_routing == "blind":
        return candidates
    warm = [c for c in candidates if has_loaded(c.info, adapter) or routed(c.worker_id)]
    if len(warm) == len(candidates):
        return warm
    if warm:
        lo, best = min(c.requests for c in candidates), min(c.requests for c in warm)
        if not (best - lo > cfg.balance_abs_threshold and best > lo * cfg.balance_rel_threshold):
            return warm
    cold = [c for c in candidates if c in warm or can_load(c.info)]
    return cold or candidates
