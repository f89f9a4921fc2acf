"""A worker's LoRA report: the load message the router routes by, `tandem:lora_requests_info`
(one label set at a time, the previous one dropped), and the load / eviction counters."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import REGISTRY

from tandem.engine.lora.registry import AdapterUse
from tandem.services.worker.lora_report import LoraInfoExporter, lora_load, with_lora
from tandem.v1 import worker_pb2


def _engine(usage, enabled=True):
    return SimpleNamespace(cfg=SimpleNamespace(enable_lora=enabled), lora_usage=lambda: list(usage),
                           loras=SimpleNamespace(max_loras=2, pool=SimpleNamespace(capacity=3), loads=0, evictions=0))


def _info(running: str, waiting: str) -> float | None:
    return REGISTRY.get_sample_value("tandem:lora_requests_info", {
        "running_lora_adapters": running, "waiting_lora_adapters": waiting, "max_lora": "2"})


def test_the_load_report_lists_every_known_adapter():
    usage = [AdapterUse("a", True, 2, 0, "ff" * 32), AdapterUse("b", False)]
    out = lora_load(_engine(usage))
    assert (out.max_loras, out.max_cpu_loras) == (2, 3)
    assert [(a.name, a.loaded, a.running, a.waiting, a.digest) for a in out.adapters] == \
        [("a", True, 2, 0, "ff" * 32), ("b", False, 0, 0, "")]
    load = with_lora(lambda: worker_pb2.WorkerLoad(running=2), _engine(usage))()
    assert load.running == 2 and [a.name for a in load.lora.adapters] == ["a", "b"]
    plain = _engine(usage, enabled=False)
    assert lora_load(plain) is None and not with_lora(worker_pb2.WorkerLoad, plain)().HasField("lora")


def test_lora_requests_info_keeps_one_label_set():
    now = [0.0]
    usage = [AdapterUse("a", True, 1, 0), AdapterUse("b", True, 0, 2), AdapterUse("c", False)]
    export = LoraInfoExporter(_engine(usage), clock=lambda: now[0])
    export()
    assert _info("a", "b") is not None
    usage[:] = [AdapterUse("a", True, 0, 0)]
    now[0] = 0.1
    export()                                   # too soon: unchanged
    assert _info("a", "b") is not None
    now[0] = 1.0
    export()
    assert _info("a", "b") is None and _info("", "") is not None


def test_loads_and_evictions_are_exported_as_they_grow():
    def counts():
        return (REGISTRY.get_sample_value("tandem_lora_loads_total"),
                REGISTRY.get_sample_value("tandem_lora_evictions_total"))
    loads0, evictions0 = counts()              # the counters are process-wide: compare deltas
    engine = _engine([])
    export = LoraInfoExporter(engine, clock=lambda: 0.0)
    export()
    assert counts() == (loads0, evictions0)
    engine.loras.loads, engine.loras.evictions = 3, 1
    export()
    export()                                   # nothing new: nothing added twice
    assert counts() == (loads0 + 3, evictions0 + 1)
    engine.loras.loads = 5
    export()                                   # every tick, not only when the info gauge is due
    assert counts() == (loads0 + 5, evictions0 + 1)
