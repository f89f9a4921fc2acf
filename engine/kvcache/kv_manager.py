"""KV pages, request slots and the prefix cache, managed together (torch-free).

Every path that ends a request's stay on this worker (finish, abort, retraction, failure) goes
through `release`, which is the one place pages and slots are returned.

With a `TierLink` (engine/kvcache/tiers/link.py; None by default, and then nothing of it runs) the
pages the prefix cache evicts are demoted to the tiers below the pool, and `admit` starts loading
the pages of a prompt the tiers hold past the L1 match instead of leaving them to be recomputed. The
load runs on the link's loader thread; the request is *loading* (`is_loading`) until `poll_loads`,
on the scheduler's thread, finds it done and moves the loaded pages into the prefix cache. A loading
request holds its slot and pages, and nothing may compute it or hand its pages to anyone else.
`release` of a loading request cancels the load first (it waits at most for the page in progress).

A request may name a `PrefixSource` (`req.kv_source`): another worker's pool that holds more of its
prompt than this worker's L1 (a prefill worker's decode peer keeps each turn's answer, which the next
turn's prompt repeats). Admission then fetches those pages from it in the same way, instead of
loading from the tiers or computing them; `req.fetched_tokens` counts them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tandem.engine.kvcache.page_allocator import PageAllocator
from tandem.engine.kvcache.radix_cache import PrefixMatch, RadixCache
from tandem.engine.kvcache.req_table import ReqToPageTable

if TYPE_CHECKING:   # annotations only: the cache serves the scheduler and never imports it
    from tandem.engine.kvcache.tiers.link import LoadJob, TierLink
    from tandem.engine.scheduler.request import Request


def _ns(req: Request) -> bytes | None:
    """The request's prefix-cache namespace: its LoRA adapter's (None: the base model's)."""
    return req.lora.cache_key if req.lora is not None else None


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class PrefixSource(Protocol):
    """Another worker's pool that holds the first `tokens` tokens of a request's prompt (whole pages).

    `start_load` fetches its pages `first..last-1` into this pool's `pages` and returns the job (a
    tiers/link.py `LoadJob`: `loaded` leading pages final once `done` is set), or None when nothing
    can be fetched; `cancel` returns once nothing of the job can still land in its pages."""

    tokens: int

    def start_load(self, first: int, last: int, pages: Sequence[int]) -> LoadJob | None: ...

    def cancel(self, job: LoadJob) -> None: ...


@dataclass(eq=False)
class _Loading:
    """A request admitted with a load in flight: its L1 match (locked), what it loads and from where
    (the tiers' link or the request's PrefixSource: `source.cancel(job)`)."""

    req: Request
    job: LoadJob
    match: PrefixMatch
    fill_ids: list[int]
    source: Any


class KVManager:
    def __init__(self, num_pages: int, page_size: int, max_slots: int, enable_prefix_cache: bool = True,
                 tiers: TierLink | None = None):
        assert tiers is None or enable_prefix_cache, "KV tiers sit below the prefix cache"
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.tiers = tiers
        hooks = {} if tiers is None else {"on_evict": tiers.demote, "key_fn": tiers.key}
        if tiers is not None and tiers.write_through:
            hooks["on_insert"] = tiers.write_through_pages
        self.cache = RadixCache(self.allocator, page_size, enabled=enable_prefix_cache, **hooks)
        self.slots = ReqToPageTable(max_slots)
        self.num_loaded_pages = 0   # pages loaded from the tiers instead of recomputed
        self.num_fetched_pages = 0  # pages fetched from another worker's pool (PrefixSource) instead
        self._loading: dict[int, _Loading] = {}   # slot -> its load in flight (admission order)

    # --- capacity ----------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.allocator.num_total

    @property
    def available_pages(self) -> int:
        """Pages obtainable right now: free plus evictable from the prefix cache."""
        return self.allocator.num_free + self.cache.evictable_pages

    def _take(self, n: int) -> list[int] | None:
        if self.allocator.num_free < n:
            self.cache.evict(n - self.allocator.num_free)
        return self.allocator.alloc(n)

    # --- per request -------------------------------------------------------------------------
    def prefix_match_len(self, token_ids: list[int]) -> int:
        """Tokens of `token_ids` the prefix cache could serve (at least one token is left to compute)."""
        return self.cache.match_prefix(token_ids[:-1]).num_tokens

    def admit(self, req: Request, fill_ids: list[int]) -> bool:
        """Reserve a slot and pages for all of `fill_ids`, reusing cached prefix pages.

        All-or-nothing: on False nothing is held. The last token is always computed (its logits
        are needed), so the cache match stops one token short. With tiers, when they hold full pages
        past the L1 match, a load of them into the new pages starts and the request is loading
        (`is_loading`) until `poll_loads` finishes it: then the loaded pages count as cached
        (`cache_len`) and computed, like the L1 match. Until then `cache_len` / `num_computed` are
        the L1 match's.
        """
        if self.slots.num_free_slots == 0:
            return False
        match = self.cache.match_prefix(fill_ids[:-1], _ns(req))
        self.cache.lock(match.node)  # before allocating: eviction must not take the matched pages
        need = pages_for(len(fill_ids), self.page_size) - len(match.pages)
        new_pages = self._take(need)
        if new_pages is None:
            self.cache.unlock(match.node)
            return False
        slot = self.slots.alloc_slot()
        assert slot is not None
        req.slot, req.cache_node, req.cache_len = slot, match.node, match.num_tokens
        req.pages = list(match.pages) + new_pages
        self.slots.set_pages(slot, req.pages)
        req.num_computed = match.num_tokens
        req.fill_len = len(fill_ids)
        source = req.kv_source
        if source is not None and source.tokens > match.num_tokens:
            self._start_load(req, fill_ids, match, new_pages, source)
        elif self.tiers is not None:
            self._start_load(req, fill_ids, match, new_pages, self.tiers)
        return True

    def _start_load(self, req: Request, fill_ids: list[int], match: PrefixMatch, new_pages: list[int],
                    source) -> None:
        """Start loading the full pages after `match` (up to one token short of `fill_ids`) that
        `source` (the tiers' link, or the request's PrefixSource) holds into the head of `new_pages`;
        `req` is loading until `poll_loads` finishes it."""
        first, last = len(match.pages), (len(fill_ids) - 1) // self.page_size
        if last <= first or not new_pages:
            return
        if source is self.tiers:
            job = self.tiers.start_load(fill_ids, first, last, new_pages, self.cache.last_key(match.node))
        else:
            last = min(last, source.tokens // self.page_size)
            job = source.start_load(first, last, new_pages[:last - first])
        if job is not None:
            self._loading[req.slot] = _Loading(req, job, match, list(fill_ids), source)

    def is_loading(self, req: Request) -> bool:
        """Whether `req`'s load (from the tiers or its PrefixSource) is still in flight (not finished
        by `poll_loads`)."""
        load = self._loading.get(req.slot) if req.slot is not None else None
        return load is not None and load.req is req

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    def poll_loads(self) -> list[Request]:
        """Finish every load that is done (never waits); returns their requests, which may be
        computed from now on. On the scheduler's thread, e.g. at the start of each step."""
        done = [load for load in self._loading.values() if load.job.done.is_set()]
        for load in done:
            del self._loading[load.req.slot]
            self._finish_load(load)
        if any(load.source is self.tiers for load in done):
            self.tiers.store.drain_events()   # what the loader's L3 promotions changed in L2
        return [load.req for load in done]

    def wait_loads(self, timeout: float) -> bool:
        """Block up to `timeout` seconds until a load in flight is done (for a caller with nothing
        else to do; `poll_loads` then finishes it). False when none is, or none is in flight. With a
        fetch from a PrefixSource among them, this waits for the oldest load."""
        if not self._loading:
            return False
        loads = list(self._loading.values())
        if all(load.source is self.tiers for load in loads):
            return self.tiers.wait_any([load.job for load in loads], timeout)
        return loads[0].job.done.wait(timeout)

    def _finish_load(self, load: _Loading) -> None:
        """Hand the pages a finished job loaded to the prefix cache (L1 again), move the request's
        lock to the longer match and count those tokens as cached and computed. A partial load
        (a block missing or corrupt part way) keeps what it loaded: the rest is recomputed."""
        req, match, ps = load.req, load.match, self.page_size
        loaded = load.job.loaded
        if loaded == 0:
            return
        first = len(match.pages)
        n = first + loaded
        ours = req.pages[first:first + loaded]
        dup = self.cache.insert(load.fill_ids[: n * ps], list(match.pages) + ours, _ns(req))
        # While the load ran, another request may have cached the same pages: the tree's serve and
        # ours are freed.
        self.allocator.free(dup)
        longer = self.cache.match_prefix(load.fill_ids[: n * ps], _ns(req))
        assert len(longer.pages) == n, (len(longer.pages), n)
        self.cache.lock(longer.node)
        self.cache.unlock(match.node)
        req.pages[:n] = longer.pages
        self.slots.set_pages(req.slot, req.pages)
        req.cache_node, req.cache_len, req.num_computed = longer.node, longer.num_tokens, longer.num_tokens
        if load.source is self.tiers:
            self.num_loaded_pages += loaded
        else:
            self.num_fetched_pages += loaded
            req.fetched_tokens = loaded * ps

    def ensure_capacity(self, req: Request, num_tokens: int) -> bool:
        """Make `req.pages` cover `num_tokens` tokens, allocating (and evicting) as needed."""
        need = pages_for(num_tokens, self.page_size) - len(req.pages)
        if need <= 0:
            return True
        new_pages = self._take(need)
        if new_pages is None:
            return False
        req.pages.extend(new_pages)
        self.slots.set_pages(req.slot, req.pages)
        return True

    def shrink(self, req: Request, num_tokens: int) -> None:
        """Free `req`'s pages beyond those covering `num_tokens` tokens (pages reserved for draft
        tokens that were rejected). Never below the computed tokens."""
        keep = pages_for(max(num_tokens, req.num_computed), self.page_size)
        if len(req.pages) > keep:
            self.allocator.free(req.pages[keep:])
            del req.pages[keep:]
            self.slots.set_pages(req.slot, req.pages)

    def release(self, req: Request, token_ids: list[int] | None = None) -> None:
        """Give back the request's slot and pages; full pages of computed tokens go to the prefix cache.

        `token_ids` are the tokens whose KV sits in `req.pages` (defaults to `req.all_ids`); only
        the first `req.num_computed` of them are trusted. Safe to call on a request holding nothing.
        A load in flight is cancelled first (this waits for the page in progress at most); what it
        loaded is dropped with the request's other pages.
        """
        if req.slot is None:
            return
        if self.is_loading(req):
            load = self._loading.pop(req.slot)
            load.source.cancel(load.job)
        ids = req.all_ids if token_ids is None else token_ids
        n_full = min(req.num_computed, len(ids)) // self.page_size
        dup = self.cache.insert(ids[: n_full * self.page_size], req.pages[:n_full], _ns(req))
        self.allocator.free(dup + req.pages[n_full:])
        self.cache.unlock(req.cache_node)
        self.slots.free_slot(req.slot)
        req.slot, req.pages, req.cache_node = None, [], None

    # --- invariants --------------------------------------------------------------------------
    def check_idle(self) -> None:
        """With no request in flight every page is free or evictable and every slot is free."""
        free, evictable = self.allocator.num_free, self.cache.evictable_pages
        assert free + evictable == self.num_pages, (
            f"KV page leak: free {free} + evictable {evictable} != total {self.num_pages}"
        )
        assert self.cache.protected_pages == 0, f"{self.cache.protected_pages} cache pages still locked"
        assert not self._loading, f"{len(self._loading)} loads from the KV tiers still in flight"
        self.slots.check_all_free()
