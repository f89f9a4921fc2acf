"""TierLink: what joins the page pool's prefix cache to the TieredStore below it (torch-free).

The KVManager owns one (or none: tiers off, and then nothing here runs). It demotes the pages the
radix cache evicts and, at admission, loads the pages of a prompt that the tiers hold past the L1
match back into the request's fresh pages. The page bytes themselves go through two callables the
model runner provides (`read_page`, `write_page`): this module never sees a tensor.

Loads are asynchronous: `start_load` (on the scheduler's thread, at admission) hashes the pages past
the match, asks the store how far the run reaches and queues a `LoadJob`; one loader thread, started
with the first job, reads each block (an L2 memcpy, or an L3 file read and checksum, both of which
release the GIL) and writes it into the job's pages, in order, one job at a time. The scheduler thread
polls `LoadJob.done` and never waits for a load except to `cancel` one (an abort, retraction or
failure of its request): that stops the job after the page in progress and returns once the thread
no longer touches its pages. Demotion stays on the scheduler thread (a page copy into L2; the disk
write is behind it, tiers/writer.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter

from tandem.engine.kvcache.radix_cache import EvictedRun
from tandem.engine.kvcache.tiers.disk import DiskTier
from tandem.engine.kvcache.tiers.host import HostTier
from tandem.engine.kvcache.tiers.store import TieredStore
from tandem.engine.kvcache.tiers.timings import TierOp
from tandem.kvblocks.keys import ROOT, Namespace, block_hash

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


@dataclass(eq=False)
class LoadJob:
    """One request's load: the blocks `keys` into `pages`, in order, on the loader thread.

    `loaded` (the leading pages written) is final once `done` is set; a block that turns out missing
    or corrupt, a failed write, or `cancel` end the job early. Until `done`, the loader may be writing
    any of `pages`: they belong to the job."""

    keys: list[bytes]
    pages: list[int]
    started: float = field(default_factory=perf_counter)
    loaded: int = 0
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class TierLink:
    """Lifecycle: built by the engine once the pool exists (tiers on) → the KVManager's radix cache
    calls `key` and `demote`, its admission `start_load` (the loader thread starts with the first
    job) → `close` with the engine: cancels the jobs, stops the loader, closes the store (safe twice).

    `sync_writes`, when set, runs on the loader thread after a job's last page write and before the
    job is done (on CUDA: wait for the thread's copies, so a forward on any stream sees the pages)."""

    store: TieredStore
    namespace: Namespace
    read_page: ReadPage
    write_page: WritePage
    sync_writes: Callable[[], None] | None = None
    write_through: bool = False   # --kv-write-policy write_through: `write_through_pages` is the cache's on_insert
    failures: int = 0   # demotions / loads that raised (logged once): the pages were recomputed
    _cv: threading.Condition = field(default_factory=threading.Condition, init=False, repr=False)
    _queue: deque[LoadJob] = field(default_factory=deque, init=False, repr=False)
    _current: LoadJob | None = field(default=None, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)
    _closed: bool = field(default=False, init=False, repr=False)

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

    def write_through_pages(self, keys: list[object], parent: object | None, pages: list[int]) -> None:
        """The radix cache's `on_insert` under write-through: each page the cache takes goes below at
        once (L2 now, L3 behind), unless a tier holds it already (a page just loaded from one, or
        computed again). Its eviction then copies nothing new. Never raises."""
        try:
            for key, page in zip(keys, pages, strict=True):
                if not self.store.lookup([key]):
                    self.store.demote(key, parent, self.read_page(page))
                parent = key
        except Exception:
            self._failed("writing KV pages through to the tiers")

    def start_load(self, token_ids: Sequence[int], first: int, last: int, pages: Sequence[int],
                   parent: object | None = None) -> LoadJob | None:
        """Queue a load of the blocks of full pages `first..last-1` of `token_ids` (pages before
        `first` are in L1 already; `parent` is the key of page `first - 1`, None at the root: the radix
        cache keeps it, so the prefix is not hashed again) into `pages[0..]`, as far as the tiers hold
        them now; None when they hold none of them (nothing to wait for). The caller owns `pages` and
        must not use them, nor reuse them, before the job is done or cancelled."""
        if self._closed or last <= first or not pages:
            return None
        ps = self.namespace.page_size
        last = min(last, first + len(pages))
        keys = []
        for i in range(first, last):
            parent = self.key(parent, token_ids[i * ps:(i + 1) * ps])
            keys.append(parent)
        try:
            found = len(self.store.lookup(keys))
        except Exception:
            self._failed("looking up KV pages")
            return None
        if found == 0:
            return None
        job = LoadJob(keys[:found], list(pages[:found]))
        with self._cv:
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tandem-kv-loader", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return job

    def cancel(self, job: LoadJob) -> None:
        """Stop a job after the page in progress; returns once the loader no longer touches its
        pages (`job.loaded` pages were written; the caller may free or reuse every page)."""
        with self._cv:
            job.cancelled = True
            if job in self._queue:
                self._queue.remove(job)
                job.done.set()
        job.done.wait()

    def wait_any(self, jobs: Sequence[LoadJob], timeout: float) -> bool:
        """Block up to `timeout` seconds until one of `jobs` is done (for a caller with nothing else
        to do); True when one is."""
        with self._cv:
            return self._cv.wait_for(lambda: any(j.done.is_set() for j in jobs), timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._current = self._queue.popleft()
            try:
                self._load(job)
            except Exception:
                self._failed("loading KV pages")   # the pages loaded so far are good; the rest is recomputed
            finally:
                with self._cv:
                    self._current = None
                    job.done.set()
                    self._cv.notify_all()

    def _load(self, job: LoadJob) -> None:
        timings = self.store.timings
        try:
            for key, page in zip(job.keys, job.pages, strict=True):
                if job.cancelled:
                    return
                t0 = perf_counter()
                tier = self.store.load_into(key, lambda payload, page=page: self.write_page(page, payload))
                if tier is None:
                    return
                timings.block(TierOp.LOAD, tier, perf_counter() - t0)
                job.loaded += 1
        finally:
            if job.loaded and self.sync_writes is not None:
                self.sync_writes()
            timings.load(perf_counter() - job.started)

    def _failed(self, what: str) -> None:
        self.failures += 1
        if self.failures == 1:
            log.exception("KV tiers: %s failed; recomputing instead (logged once)", what)

    def close(self, timeout: float = 5.0) -> None:
        """Cancel the queued and running loads (their requests recompute, or are gone), stop the
        loader thread, close the store. The KVManager still frees the jobs' pages through `release`."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            for job in self._queue:
                job.cancelled = True
                job.done.set()
            self._queue.clear()
            if self._current is not None:
                self._current.cancelled = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("KV tiers: the loader did not stop within %.1fs; closing the store anyway", timeout)
        self.store.close()
