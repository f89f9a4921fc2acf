"""A worker's LoRA adapters as the router and Prometheus see them: every known adapter, whether it is
loaded, and the requests running and waiting on it (engine.lora.registry.AdapterUse), in the load
report (`WorkerLoad.lora`, what LoRA-aware routing reads) and as `tandem:lora_requests_info`; and how
often it reads an adapter from disk and drops one to make room (`tandem_lora_loads_total`,
`tandem_lora_evictions_total`: what LoRA-aware routing saves, bench/lora_routing.py).

The gauge follows vLLM's `vllm:lora_requests_info`: one sample whose labels carry the state (the
adapters with running requests, those with waiting ones, comma-separated, and --max-loras) and whose
value is when it was taken; the previous label set is dropped, so the series stays one.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge

from tandem.v1 import worker_pb2

LORA_REQUESTS_INFO = Gauge("tandem:lora_requests_info", "LoRA adapters with running / waiting requests (value: "
                           "when sampled)", ["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
LORA_LOADS = Counter("tandem_lora_loads_total", "LoRA adapters read from disk (lazily for a request, at start "
                     "with --lora-eager-load, or by a runtime load)")
LORA_EVICTIONS = Counter("tandem_lora_evictions_total", "Loaded LoRA adapters dropped to make room for another "
                         "(--max-cpu-loras; least recently used idle one first)")
EXPORT_EVERY_S = 0.5


def lora_load(engine) -> worker_pb2.LoraLoad | None:
    """The report of an engine serving adapters; None when LoRA is off."""
    if not engine.cfg.enable_lora:
        return None
    loras = engine.loras
    return worker_pb2.LoraLoad(
        adapters=[worker_pb2.LoraAdapterLoad(name=u.name, loaded=u.loaded, running=u.running, waiting=u.waiting,
                                             digest=u.digest) for u in engine.lora_usage()],
        max_loras=loras.max_loras, max_cpu_loras=loras.pool.capacity)


def with_lora(load_fn, engine):
    """`load_fn` (a role's WorkerLoad) with the engine's LoRA report added."""
    if not engine.cfg.enable_lora:
        return load_fn

    def load() -> worker_pb2.WorkerLoad:
        out = load_fn()
        out.lora.CopyFrom(lora_load(engine))
        return out
    return load


class LoraInfoExporter:
    """Engine-loop ticker: adds what the registry's load and eviction counts gained since the last tick
    to their counters (every tick: two int compares), and refreshes `tandem:lora_requests_info` at most
    every EXPORT_EVERY_S."""

    def __init__(self, engine, clock=time.monotonic):
        self.engine = engine
        self.clock = clock
        self._last = float("-inf")
        self._counted = (0, 0)   # the registry's (loads, evictions) already in the counters

    def __call__(self) -> None:
        loras = self.engine.loras
        loads, evictions = loras.loads, loras.evictions
        if (loads, evictions) != self._counted:
            LORA_LOADS.inc(loads - self._counted[0])
            LORA_EVICTIONS.inc(evictions - self._counted[1])
            self._counted = (loads, evictions)
        now = self.clock()
        if now - self._last < EXPORT_EVERY_S:
            return
        self._last = now
        usage = self.engine.lora_usage()
        LORA_REQUESTS_INFO.clear()
        LORA_REQUESTS_INFO.labels(",".join(u.name for u in usage if u.running),
                                  ",".join(u.name for u in usage if u.waiting),
                                  str(self.engine.loras.max_loras)).set(time.time())
