"""KV pages, request slots and the prefix cache, managed together (torch-free).

Every path that ends a request's stay on this worker (finish, abort, retraction, failure) goes
through `release`, which is the one place pages and slots are returned.

With a `TierLink` (engine/kvcache/tiers/link.py; None by default, and then nothing of it runs) the
pages the prefix cache evicts are demoted to the tiers below the pool, and `admit` loads the pages
of a prompt the tiers hold past the L1 match instead of leaving them to be recomputed (synchronously,
for now: see link.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.kvcache.page_allocator import PageAllocator
from engine.kvcache.radix_cache import PrefixMatch, RadixCache
from engine.kvcache.req_table import ReqToPageTable

if TYPE_CHECKING:   # annotations only: the cache serves the scheduler and never imports it
    from engine.kvcache.tiers.link import TierLink
    from engine.scheduler.request import Request


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class KVManager:
    def __init__(self, num_pages: int, page_size: int, max_slots: int, enable_prefix_cache: bool = True,
                 tiers: TierLink | None = None):
        assert tiers is None or enable_prefix_cache, "KV tiers sit below the prefix cache"
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.tiers = tiers
        hooks = {} if tiers is None else {"on_evict": tiers.demote, "key_fn": tiers.key}
        self.cache = RadixCache(self.allocator, page_size, enabled=enable_prefix_cache, **hooks)
        self.slots = ReqToPageTable(max_slots)
        self.num_loaded_pages = 0   # pages `admit` loaded from the tiers instead of recomputing

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
        are needed), so the cache match stops one token short. With tiers, the full pages past the
        L1 match that they hold are loaded into the new pages and count as cached (`cache_len`) and
        computed, like the L1 match.
        """
        if self.slots.num_free_slots == 0:
            return False
        match = self.cache.match_prefix(fill_ids[:-1])
        self.cache.lock(match.node)  # before allocating: eviction must not take the matched pages
        need = pages_for(len(fill_ids), self.page_size) - len(match.pages)
        new_pages = self._take(need)
        if new_pages is None:
            self.cache.unlock(match.node)
            return False
        if self.tiers is not None:
            match = self._load_from_tiers(fill_ids, match, new_pages)
        slot = self.slots.alloc_slot()
        assert slot is not None
        req.slot, req.cache_node, req.cache_len = slot, match.node, match.num_tokens
        req.pages = list(match.pages) + new_pages
        self.slots.set_pages(slot, req.pages)
        req.num_computed = match.num_tokens
        req.fill_len = len(fill_ids)
        return True

    def _load_from_tiers(self, fill_ids: list[int], match: PrefixMatch, new_pages: list[int]) -> PrefixMatch:
        """Load the full pages after `match` (up to one token short of `fill_ids`) that the tiers
        hold into the head of `new_pages`, hand them to the prefix cache (L1 again) and move the
        request's lock to the longer match; returns that match. `new_pages` loses the pages the tree
        took. Nothing can fail half-way: the pages were already the request's."""
        ps = self.page_size
        first, last = len(match.pages), (len(fill_ids) - 1) // ps
        if last <= first or not new_pages:
            return match
        loaded = self.tiers.load_prefix(fill_ids, first, last, new_pages, self.cache.last_key(match.node))
        if loaded == 0:
            return match
        n = first + loaded
        dup = self.cache.insert(fill_ids[: n * ps], list(match.pages) + new_pages[:loaded])
        # The match was the tree's longest and stays locked, so the loaded pages extend it and
        # nothing should come back; were one to, the tree's page serves and ours is freed.
        self.allocator.free(dup)
        longer = self.cache.match_prefix(fill_ids[: n * ps])
        assert len(longer.pages) == n, (len(longer.pages), n)
        self.cache.lock(longer.node)
        self.cache.unlock(match.node)
        del new_pages[:loaded]
        self.num_loaded_pages += loaded
        return longer

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
        """
        if req.slot is None:
            return
        ids = req.all_ids if token_ids is None else token_ids
        n_full = min(req.num_computed, len(ids)) // self.page_size
        dup = self.cache.insert(ids[: n_full * self.page_size], req.pages[:n_full])
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
        self.slots.check_all_free()
