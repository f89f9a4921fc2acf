"""A worker's adapters. *Known*: registered by `--lora-modules name=path` at start (their configs
checked then: a bad one stops the start with a message that names it) or by a runtime load. *Loaded*:
weights in memory, at most `--max-cpu-loras` (pool.py, least recently used out first, never one a
request in flight uses). A known adapter is loaded from disk when a request first needs it, unless
`--lora-eager-load` loads every `--lora-modules` one at start.

Every change of the loaded set rebuilds the `Stack` and hands it to `on_stack` (the model runner).
The registry is used on the engine thread only (requests are made and runtime loads run between
steps), so a step never sees the set change under it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.errors import Conflict, InvalidRequest, ModelNotFound
from tandem.engine.lora.adapters import LoraAdapter, check_adapter, load_adapter
from tandem.engine.lora.batch import choose
from tandem.engine.lora.pool import AdapterPool
from tandem.engine.models.config import ModelConfig


@dataclass(frozen=True)
class AdapterUse:
    """One known adapter's state, for load reports and metrics."""

    name: str
    loaded: bool
    running: int = 0
    waiting: int = 0
    digest: str = ""    # while loaded (engine/lora/adapters.py LoraAdapter.digest)


class LoraRegistry:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 on_stack: Callable[[Stack | None], None] = lambda stack: None, cpu_ops=None):
        """`cpu_ops`: kernels.cpu's module where the model runner loaded Tandem's CPU kernels (batch.py
        `choose`: then they apply the adapters)."""
        self.enabled = cfg.enable_lora
        self.path = choose(device, dtype, cpu_ops)   # triton, cpu or torch (batch.py)
        self._cpu_ops = cpu_ops if self.path == "cpu" else None
        self.max_loras = cfg.max_loras
        self.max_rank = cfg.max_lora_rank
        self._load_args = (model_cfg, dtype, device)
        self._on_stack = on_stack
        self.known: dict[str, str] = {}           # name -> PEFT folder
        self.adapters: dict[str, LoraAdapter] = {}   # the loaded ones
        self.pool = AdapterPool(cfg.max_cpu_loras if cfg.max_cpu_loras is not None else cfg.max_loras)
        self.stack: Stack | None = None
        # Monotonic counts since start (the worker exports them as tandem_lora_loads_total /
        # tandem_lora_evictions_total): adapters read from disk, and loaded ones dropped to make room
        # for another (a runtime unload is not an eviction).
        self.loads = 0
        self.evictions = 0
        for name, path in cfg.lora_modules:
            check_adapter(name, path, self.max_rank)
            self.known[name] = path
        if cfg.lora_eager_load:
            for name in self.known:
                self.acquire(name, ())

    def acquire(self, name: str, in_use: Collection[str]) -> LoraAdapter:
        """The adapter a request names, loaded (from disk if it is not; the least recently used idle one
        out if the pool is full) and marked most recently used. `in_use`: adapters of requests in flight.
        Raises InvalidRequest (param `model`) for an unknown name or a file that fails to load,
        ResourceExhausted when every loaded adapter is in use."""
        adapter = self.adapters.get(name)
        if adapter is not None:
            self.pool.touch(name)
            return adapter
        path = self.known.get(name)
        if path is None:
            known = ", ".join(sorted(self.known)) or "none"
            what = "LoRA is off (--enable-lora)" if not self.enabled else f"adapters here: {known}"
            raise InvalidRequest(f"no LoRA adapter {name!r} ({what})", "model")
        return self._load(name, path, in_use)

    def register(self, name: str, path: str, in_use: Collection[str]) -> LoraAdapter:
        """A runtime load: read and check the adapter now (a malformed one raises InvalidRequest saying
        what is wrong, and nothing changes), then keep it known and loaded."""
        if not self.enabled:
            raise InvalidRequest("LoRA is off on this worker (--enable-lora)", "lora_name")
        if not name:
            raise InvalidRequest("lora_name is empty", "lora_name")
        if name in self.known:
            raise InvalidRequest(f"LoRA adapter {name!r} is already loaded (from {self.known[name]}); unload it "
                                 "first", "lora_name")
        adapter = self._load(name, path, in_use)
        self.known[name] = path
        return adapter

    def unregister(self, name: str, in_use: Collection[str]) -> None:
        """A runtime unload. Raises ModelNotFound for an unknown adapter, Conflict while requests in flight
        use it (refused, not waited for: the caller retries once they finished)."""
        if name not in self.known:
            raise ModelNotFound(f"no LoRA adapter {name!r} to unload (adapters here: "
                                f"{', '.join(sorted(self.known)) or 'none'})")
        if name in in_use:
            raise Conflict(f"LoRA adapter {name!r} is used by requests in flight; unload it when they finished")
        del self.known[name]
        if self.adapters.pop(name, None) is not None:
            self.pool.remove(name)
            self._restack()

    def usage(self, running: Collection[str | None], waiting: Collection[str | None]) -> list[AdapterUse]:
        """Every known adapter with how many of `running` / `waiting` (each request's adapter name) use it."""
        def count(names, n):
            return sum(1 for x in names if x == n)
        return [AdapterUse(n, n in self.adapters, count(running, n), count(waiting, n),
                           self.adapters[n].digest if n in self.adapters else "") for n in sorted(self.known)]

    def _load(self, name: str, path: str, in_use: Collection[str]) -> LoraAdapter:
        victims = self.pool.evictions(name, in_use)   # raises before anything is read or dropped
        model_cfg, dtype, device = self._load_args
        adapter = load_adapter(name, path, model_cfg, max_rank=self.max_rank, dtype=dtype, device=device)
        for victim in victims:
            del self.adapters[victim]
            self.pool.remove(victim)
        self.loads += 1
        self.evictions += len(victims)
        self.adapters[name] = adapter
        self.pool.add(name)
        self._restack()
        return adapter

    def _restack(self) -> None:
        # The torch paths stack only several adapters (one alone is applied segmented); the kernels read
        # stacked weights whatever their number (batch.py choose).
        fewest = 2 if self.path == "torch" else 1
        self.stack = Stack(list(self.adapters.values()), self._cpu_ops) if len(self.adapters) >= fewest else None
        self._on_stack(self.stack)


class Stack:
    """Every loaded adapter's blocks side by side, per (layer, fused projection): A_all `[S, in]`, B_all
    `[out, S]`, and its layout (which adapter each of the S columns belongs to) that row masks follow.
    `spans[layout id]`: the same layout as the kernels read it (kernels/lora.py): `[count, 2]` int32 on
    the weights' device, each adapter's first column and rank (0 where it does not adapt that
    projection), and the largest rank.

    With `cpu_ops` (kernels.cpu's module: the CPU kernel applies them, batch.py), B_all is kept
    transposed (`[out, S]`, column-major) and `cpu[(layer, projection)]` is what the kernel reads:
    `B_all.t()` (contiguous `[S, out]`: each column's outputs side by side), the parts it multiplies
    (int32 `[P, 4]`: each part's first column, rank, first output and outputs; one per adapted module
    of a fused q/k/v or gate/up block) and where each adapter's parts start (int32 `[count + 1]`)."""

    def __init__(self, adapters: list[LoraAdapter], cpu_ops=None):
        self.count = len(adapters)
        self.cpu_ops = cpu_ops
        self.cpu: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.index = {a.name: i for i, a in enumerate(adapters)}
        # (layer, projection) -> (A_all, B_all, layout id); layout id -> (owner of each column, dtype)
        self.weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._columns: list[tuple[torch.Tensor, torch.dtype]] = []
        self.spans: list[tuple[torch.Tensor, int]] = []
        layouts: dict[tuple[int, ...], int] = {}
        for key in sorted({k for a in adapters for k in a.blocks}):
            present = [(i, a.blocks[key]) for i, a in enumerate(adapters) if key in a.blocks]
            a_all = torch.cat([a for _, (a, _) in present]).contiguous()
            layout = tuple(i for i, (a, _) in present for _ in range(a.shape[0]))
            if layout not in layouts:
                layouts[layout] = len(self._columns)
                self._columns.append((torch.tensor(layout, dtype=torch.int64), a_all.dtype))
                ranks = [layout.count(i) for i in range(self.count)]
                starts = [layout.index(i) if r else 0 for i, r in enumerate(ranks)]
                self.spans.append((torch.tensor(list(zip(starts, ranks, strict=True)), dtype=torch.int32,
                                                device=a_all.device), max(ranks)))
            b_all = torch.cat([b for _, (_, b) in present], dim=1)
            b_all = b_all.t().contiguous().t() if cpu_ops is not None else b_all.contiguous()
            self.weights[key] = (a_all, b_all, layouts[layout])
            if cpu_ops is not None:
                self.cpu[key] = (b_all.t(), *self._parts(adapters, key, tables))

    def _parts(self, adapters: list[LoraAdapter], key: tuple[int, str], tables: dict) -> tuple[torch.Tensor, torch.Tensor]:
        rows, first, col = [], [0], 0
        for adapter in adapters:
            block = adapter.blocks.get(key)
            if block is not None:
                a, b = block
                parts = adapter.parts.get(key) or ((0, b.shape[0]),)
                rank = a.shape[0] // len(parts)
                assert rank * len(parts) == a.shape[0], (adapter.name, key, parts)
                rows.extend((col + i * rank, rank, out, n) for i, (out, n) in enumerate(parts))
                col += a.shape[0]
            first.append(len(rows))
        table = (tuple(rows), tuple(first))
        if table not in tables:   # most layers share one
            tables[table] = (torch.tensor(rows, dtype=torch.int32).view(-1, 4), torch.tensor(first, dtype=torch.int32))
        return tables[table]

    def masks(self, owner: list[str | None], device) -> list[torch.Tensor]:
        """Per layout id, `[rows, S]`: 1 in each row's own adapter's columns (rows of the base model: 0)."""
        rows = torch.tensor([self.index.get(name, -1) if name is not None else -1 for name in owner],
                            dtype=torch.int64)
        return [(rows[:, None] == cols[None, :]).to(device=device, dtype=dtype) for cols, dtype in self._columns]
