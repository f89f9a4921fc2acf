"""TierLink: what joins the page pool's prefix cache to the TieredStore below it (torch-free).

The KVManager owns one (or none: tiers off, and then nothing here runs). It demotes the pages the
radix cache evicts and, at admission, loads the pages of a prompt that the tiers hold past the L1
match back into the request's fresh pages. The page bytes themselves go through two callables the
model runner provides (`read_page`, `write_page`): this module never sees a tensor.

Known limit: loads are synchronous, on the scheduler's thread, inside admission (an L2 hit is a
memcpy, an L3 hit one small file read per page). Next: a loader thread, the request waiting for its
own load while other requests keep running.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.kvcache.radix_cache import EvictedRun
from engine.kvcache.tiers.block_hash import ROOT, Namespace, block_hash
from engine.kvcache.tiers.disk import DiskTier
from engine.kvcache.tiers.host import HostTier
from engine.kvcache.tiers.store import TieredStore

# read_page(page id) -> that page's KV, every layer, K and V, packed (valid until the next call).
ReadPage = Callable[[int], memoryview | bytes]
# write_page(page id, payload): unpack a block into that page of the pool.
WritePage = Callable[[int, memoryview | bytes], None]

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """A hash of the checkpoint: config.json's bytes and every weight file's name and size, so two
    fine-tunes of one architecture (or a re-downloaded checkpoint with other weights) do not share
    blocks. Reads no weights: names and sizes are what distinguishes checkpoints cheaply."""
    root = Path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    config = root / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for p in sorted(root.iterdir()):
        if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES):
            h.update(json.dumps([p.name, p.stat().st_size]).encode())
    return h.hexdigest()


GIB = 1 << 30


def open_store(namespace: Namespace, block_bytes: int, host_gb: float, disk_dir: str | None,
               disk_gb: float) -> TieredStore:
    """The TieredStore the engine flags ask for (`--kv-host-cache-gb`, `--kv-disk-cache-dir`,
    `--kv-disk-cache-gb`); ValueError naming the flag when a tier cannot start."""
    host = HostTier(int(host_gb * GIB), block_bytes) if host_gb > 0 else None
    disk = DiskTier(disk_dir, int(disk_gb * GIB), namespace) if disk_dir else None
    return TieredStore(host, disk)


@dataclass
class TierLink:
    """Lifecycle: built by the engine once the pool exists (tiers on) → the KVManager's radix cache
    calls `key` and `demote`, its admission `load_prefix` → `close` with the engine (safe twice)."""

    store: TieredStore
    namespace: Namespace
    read_page: ReadPage
    write_page: WritePage
    failures: int = 0   # demotions / loads that raised (logged once): the pages were recomputed

    def key(self, parent: object | None, page_tokens: Sequence[int]) -> bytes:
        """The radix cache's `key_fn`: the block hash chain."""
        return block_hash(self.namespace, ROOT if parent is None else parent, page_tokens)

    def demote(self, run: EvictedRun) -> None:
        """The radix cache's `on_evict`: each page's KV into the store (a copy; L3 behind). Never
        raises: an eviction must finish whatever happens below the pool."""
        assert run.keys is not None, "TierLink needs the radix cache's key_fn"
        parent = run.parent
        try:
            for key, page in zip(run.keys, run.pages, strict=True):
                self.store.demote(key, parent, self.read_page(page))
                parent = key
        except Exception:
            self._failed("demoting evicted KV pages")

    def load_prefix(self, token_ids: Sequence[int], first: int, last: int, pages: Sequence[int],
                    parent: object | None = None) -> int:
        """Load the blocks of full pages `first..last-1` of `token_ids` (pages before `first` are in
        L1 already; `parent` is the key of page `first - 1`, None at the root: the radix cache keeps
        it, so the prefix is not hashed again) into `pages[0..]`, as far as the tiers hold them;
        returns how many were loaded. A block that turns out missing or corrupt ends the run (the
        rest is recomputed)."""
        if last <= first or not pages:
            return 0
        ps = self.namespace.page_size
        last = min(last, first + len(pages))
        keys = []
        for i in range(first, last):
            parent = self.key(parent, token_ids[i * ps:(i + 1) * ps])
            keys.append(parent)
        loaded = 0
        try:
            found = self.store.lookup(keys)
            for key, page in zip(keys[:len(found)], pages, strict=False):
                payload = self.store.load(key)
                if payload is None:
                    break
                self.write_page(page, payload)   # before the next store call: an L2 view may move
                loaded += 1
        except Exception:
            self._failed("loading KV pages")   # the pages loaded so far are good; the rest is recomputed
        return loaded

    def _failed(self, what: str) -> None:
        self.failures += 1
        if self.failures == 1:
            log.exception("KV tiers: %s failed; recomputing instead (logged once)", what)

    def close(self) -> None:
        self.store.close()
