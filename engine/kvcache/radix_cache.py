"""Page-granular radix prefix cache with LRU eviction and lock counts (torch-free).

Keys are token-id sequences cut into `page_size` chunks. Every edge of the tree holds whole pages
only: its token ids (a multiple of `page_size` long) and the KV page ids that hold them. A trailing
partial page is never cached, so a page in the tree is always full and immutable.

Ownership: pages in the tree belong to the tree. A request that matched a prefix uses the tree's
pages while it holds a lock on the match node; the pages it allocated itself are its own until it
hands them over with `insert`, which gives back the ones the tree already had.

Eviction hook (optional, for the KV tiers below the pool): `on_evict` hears every page leaving the
tree, before it goes back to the allocator, so its KV can still be read. With `key_fn` the cache also
hands each page's key, a chain `key_fn(parent_key, page_token_ids)` computed lazily at eviction from
the root down and cached on the nodes: the cache never interprets keys (it stays hash-free), and
without a hook nothing of this runs.

Namespaces: KV computed under different weights (a LoRA adapter, engine/lora/) must never be
shared, so each namespace has a root of its own; `match_prefix` and `insert` take it (None: the base
model's). A namespace's root carries its key (`ns`, an opaque object such as the adapter's digest),
which is the parent key of its first pages: the key chains of two namespaces never meet.

Insert hook (optional, for KV events to the router and the tiers' write-through; needs `key_fn`):
`on_insert` hears the keys and page ids of the pages an `insert` adds to the tree (pages it already
held are not told again), so that together with `on_evict` a listener can follow exactly which pages
the tree holds.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem.engine.kvcache.page_allocator import PageAllocator

# key_fn(parent key or None at the root, one page's token ids) -> that page's key (opaque here).
KeyFn = Callable[[object | None, Sequence[int]], object]


@dataclass(frozen=True)
class EvictedRun:
    """Consecutive pages of one edge leaving the tree (their KV is still in the pool).

    `keys[i]` is the key of `pages[i]` and `parent` the key of the page before the run (None at the
    root); both None-filled / None when the cache has no `key_fn`."""

    page_tokens: list[tuple[int, ...]]
    pages: list[int]
    keys: list[object] | None
    parent: object | None


EvictHook = Callable[[EvictedRun], None]
# on_insert(keys of the pages added, in order; key of the page before them, None at the root; the
# pages themselves, whose KV is in the pool)
InsertHook = Callable[[list[object], object | None, list[int]], None]


class RadixNode:
    """One edge of the tree (plus the node it leads to). Opaque to callers: a lock handle."""

    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access", "uid", "page_keys", "ns")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: RadixNode | None, uid: int):
        self.key = key  # token ids on this edge; len == len(pages) * page_size
        self.pages = pages
        # Child edges indexed by their first page's token ids: siblings differ within one page.
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        # Number of locks held on this node or any descendant: a node is protected while > 0.
        self.lock_ref = 0
        self.last_access = 0
        self.uid = uid  # creation order; breaks LRU ties deterministically
        # One key_fn key per page, filled at the first eviction below this node (None until then);
        # kept aligned with `pages` by split and trim.
        self.page_keys: list[object] | None = None
        self.ns: object | None = None   # a root: its namespace, the parent key of its first pages

    def __repr__(self) -> str:
        return f"RadixNode(uid={self.uid}, pages={self.pages}, lock_ref={self.lock_ref})"


@dataclass
class PrefixMatch:
    """Result of `RadixCache.match_prefix`.

    `pages` are the tree's pages for the matched prefix (in order); `node` is the handle to pass
    to `lock` / `unlock` so those pages stay cached while the request uses them.
    """

    pages: list[int]
    node: RadixNode
    page_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.pages) * self.page_size


class RadixCache:
    """Prefix cache over KV pages.

    Eviction policy: least recently used leaf first. When a leaf holds more pages than still
    needed, only its tail pages are evicted, so `evict(n)` frees exactly `min(n, evictable_pages)`
    pages and keeps the head of the prefix, which more requests share. A parent whose last child
    went becomes an eviction candidate in the same call.
    """

    def __init__(self, allocator: PageAllocator, page_size: int, enabled: bool = True,
                 on_evict: EvictHook | None = None, key_fn: KeyFn | None = None,
                 on_insert: InsertHook | None = None):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        assert on_insert is None or key_fn is not None, "on_insert hands keys: it needs a key_fn"
        self.allocator = allocator
        self.page_size = page_size
        self.enabled = enabled
        self.on_evict = on_evict
        self.key_fn = key_fn
        self.on_insert = on_insert
        self._next_uid = 0
        self._clock = 0  # monotonic LRU clock: deterministic, unlike wall time
        self._new_root()

    def _new_root(self) -> None:
        self._root = self._make_node((), [], None)
        self._roots: dict[object | None, RadixNode] = {None: self._root}
        self._evictable_pages = 0
        self._protected_pages = 0

    def _root_of(self, ns: object | None) -> RadixNode:
        root = self._roots.get(ns)
        if root is None:
            root = self._roots[ns] = self._make_node((), [], None)
            root.ns = ns
        return root

    def _make_node(self, key: tuple[int, ...], pages: list[int], parent: RadixNode | None) -> RadixNode:
        node = RadixNode(key, pages, parent, self._next_uid)
        self._next_uid += 1
        return node

    @property
    def evictable_pages(self) -> int:
        """Pages in unlocked nodes (all of them can be freed by `evict`)."""
        return self._evictable_pages

    @property
    def protected_pages(self) -> int:
        """Pages in locked nodes."""
        return self._protected_pages

    @property
    def total_pages(self) -> int:
        return self._evictable_pages + self._protected_pages

    # ---- lookup / insert -------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], ns: object | None = None) -> PrefixMatch:
        """Longest cached prefix of `token_ids` in whole pages; a trailing partial page is ignored.

        Marks the matched nodes as recently used and splits an edge when the match ends inside it,
        so the returned node covers exactly the matched pages. Takes no lock: the caller locks
        `node` before anything can evict. A caller that needs at least one token to compute should
        match `token_ids[:-1]`. `ns`: the namespace (None: the base model's).
        """
        node = self._root_of(ns)
        pages: list[int] = []
        if not self.enabled:
            return PrefixMatch(pages, node, self.page_size)
        ps = self.page_size
        n = len(token_ids) // ps * ps
        pos = 0
        self._clock += 1
        while pos < n:
            child = node.children.get(tuple(token_ids[pos : pos + ps]))
            if child is None:
                break
            m = self._match_pages(child.key, token_ids, pos, n)
            if m < len(child.pages):
                child = self._split(child, m)
            child.last_access = self._clock
            pages.extend(child.pages)
            node = child
            pos += m * ps
        return PrefixMatch(pages, node, self.page_size)

    def insert(self, token_ids: Sequence[int], pages: Sequence[int], ns: object | None = None) -> list[int]:
        """Cache `token_ids` (whole pages only) backed by `pages`; the tree takes ownership.

        Returns the caller's pages the tree did not take because that chunk is already cached
        under a different page id: the caller must free them. A page that the tree already holds
        at that position (the caller got it from `match_prefix`) is neither taken nor returned.
        When the cache is disabled every page is returned. `ns`: the namespace (as `match_prefix`).
        """
        ps = self.page_size
        if len(token_ids) != len(pages) * ps:
            raise ValueError(
                f"insert needs whole pages: {len(token_ids)} tokens for {len(pages)} pages of {ps}"
            )
        if not self.enabled:
            return list(pages)
        self._clock += 1
        node = self._root_of(ns)
        to_free: list[int] = []
        i = 0  # page index into `pages`
        num = len(pages)
        while i < num:
            pos = i * ps
            child = node.children.get(tuple(token_ids[pos : pos + ps]))
            if child is None:
                leaf = self._make_node(tuple(token_ids[pos:]), list(pages[i:]), node)
                leaf.last_access = self._clock
                node.children[leaf.key[:ps]] = leaf
                self._evictable_pages += len(leaf.pages)
                if self.on_insert is not None:
                    self._fill_keys(leaf)
                    self.on_insert(list(leaf.page_keys), self._last_key(node), list(leaf.pages))
                break
            m = self._match_pages(child.key, token_ids, pos, len(token_ids))
            if m < len(child.pages):
                child = self._split(child, m)
            for held, given in zip(child.pages, pages[i : i + m], strict=True):
                if held != given:
                    to_free.append(given)
            child.last_access = self._clock
            node = child
            i += m
        return to_free

    def _match_pages(self, key: tuple[int, ...], token_ids: Sequence[int], pos: int, end: int) -> int:
        """Number of whole pages of `key` equal to `token_ids[pos:end]` (the first page matches)."""
        ps = self.page_size
        limit = min(len(key), end - pos)
        m = 1
        while (m + 1) * ps <= limit and key[m * ps : (m + 1) * ps] == tuple(
            token_ids[pos + m * ps : pos + (m + 1) * ps]
        ):
            m += 1
        return m

    def _split(self, child: RadixNode, m: int) -> RadixNode:
        """Cut `child`'s edge after `m` pages; return the new upper node."""
        ps = self.page_size
        parent = child.parent
        assert parent is not None and 0 < m < len(child.pages)
        mid = self._make_node(child.key[: m * ps], child.pages[:m], parent)
        # Every lock below `child` counted on its ancestors; `mid` is a new ancestor, so it
        # inherits the count (and the protected/evictable totals stay unchanged).
        mid.lock_ref = child.lock_ref
        mid.last_access = child.last_access
        if child.page_keys is not None:
            mid.page_keys, child.page_keys = child.page_keys[:m], child.page_keys[m:]
        child.key = child.key[m * ps :]
        child.pages = child.pages[m:]
        child.parent = mid
        mid.children[child.key[:ps]] = child
        parent.children[mid.key[:ps]] = mid
        return mid

    # ---- locks -----------------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        """Protect `node` and its ancestors from eviction (counted; pair with `unlock`)."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable_pages -= len(node.pages)
                self._protected_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Release one `lock` on `node`. Raises AssertionError if it was not locked."""
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise AssertionError(f"unlock of unlocked radix node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected_pages -= len(node.pages)
                self._evictable_pages += len(node.pages)
            node = node.parent

    # ---- eviction --------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` unlocked pages to the allocator, LRU leaf first; returns how many.

        Walks the tree to collect leaves (O(nodes)): eviction runs when allocation fails, not
        every step.
        """
        if not self.enabled or num_pages <= 0:
            return 0
        heap = [(n.last_access, n.uid, n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, leaf = heapq.heappop(heap)
            need = num_pages - len(freed)
            if need < len(leaf.pages):
                # Trim the tail only: the remaining head is still a valid cached prefix.
                if self.on_evict is not None:
                    self._tell_evicted(leaf, len(leaf.pages) - need)
                freed.extend(leaf.pages[-need:])
                del leaf.pages[-need:]
                if leaf.page_keys is not None:
                    del leaf.page_keys[-need:]
                leaf.key = leaf.key[: len(leaf.pages) * self.page_size]
                self._evictable_pages -= need
                break
            if self.on_evict is not None:
                self._tell_evicted(leaf, 0)
            freed.extend(leaf.pages)
            self._evictable_pages -= len(leaf.pages)
            parent = leaf.parent
            del parent.children[leaf.key[: self.page_size]]
            leaf.parent = None
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        self.allocator.free(freed)
        return len(freed)

    def _tell_evicted(self, node: RadixNode, start: int) -> None:
        """Call `on_evict` for `node.pages[start:]` (still in the tree, still in the pool)."""
        ps = self.page_size
        tokens = [node.key[i * ps : (i + 1) * ps] for i in range(start, len(node.pages))]
        keys = parent = None
        if self.key_fn is not None:
            self._fill_keys(node)
            keys = node.page_keys[start:]
            parent = node.page_keys[start - 1] if start else self._last_key(node.parent)
        self.on_evict(EvictedRun(tokens, node.pages[start:], keys, parent))

    def last_key(self, node: RadixNode) -> object | None:
        """The `key_fn` key of `node`'s last page (a root's: its namespace, None for the base model's: an
        empty match), computed once and kept on the nodes like the eviction keys."""
        assert self.key_fn is not None, "last_key needs a key_fn"
        if node.parent is None:
            return node.ns
        self._fill_keys(node)
        return node.page_keys[-1]

    def _last_key(self, node: RadixNode | None) -> object | None:
        if node is None:
            return None
        return node.ns if node.parent is None else node.page_keys[-1]

    def _fill_keys(self, node: RadixNode) -> None:
        # Ancestors first (root down), each node's keys computed once and kept.
        path = []
        while node.parent is not None and node.page_keys is None:
            path.append(node)
            node = node.parent
        ps = self.page_size
        for n in reversed(path):
            prev = self._last_key(n.parent)
            keys = []
            for i in range(len(n.pages)):
                prev = self.key_fn(prev, n.key[i * ps : (i + 1) * ps])
                keys.append(prev)
            n.page_keys = keys

    def _leaves(self) -> list[RadixNode]:
        leaves = []
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves

    # ---- lifecycle / checks ----------------------------------------------------------------

    def reset(self) -> None:
        """Free every cached page to the allocator. Only valid while nothing is locked."""
        if self._protected_pages:
            raise AssertionError(f"radix cache reset with {self._protected_pages} locked pages")
        if self.on_evict is not None:
            self.evict(self._evictable_pages)   # every page through the hook, as an eviction
        self.allocator.free(self.cached_pages())
        self._new_root()

    def page_keys(self) -> list[tuple[object, object | None]]:
        """(key, parent key) of every page in the tree, parents before children: what an
        `on_insert` / `on_evict` listener starts from (a KV event snapshot). Needs `key_fn`; O(pages)."""
        assert self.key_fn is not None, "page_keys needs a key_fn"
        out: list[tuple[object, object | None]] = []
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            self._fill_keys(node)
            parent = self._last_key(node.parent)
            for key in node.page_keys:
                out.append((key, parent))
                parent = key
            stack.extend(node.children.values())
        return out

    def cached_pages(self) -> list[int]:
        """All page ids held by the tree (for checks and debugging; O(nodes))."""
        out: list[int] = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            out.extend(node.pages)
            stack.extend(node.children.values())
        return out

    def check_consistency(self) -> None:
        """Assert the tree's structure and page counters agree (for tests; O(nodes))."""
        ps = self.page_size
        evictable = protected = 0
        seen: set[int] = set()
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                assert node.pages, f"empty non-root node {node!r}"
                assert len(node.key) == len(node.pages) * ps, f"key/pages size mismatch in {node!r}"
                assert node.lock_ref >= 0, f"negative lock count in {node!r}"
                if node.lock_ref:
                    protected += len(node.pages)
                else:
                    evictable += len(node.pages)
            assert seen.isdisjoint(node.pages), f"page cached twice under {node!r}"
            seen.update(node.pages)
            child_locks = 0
            for first, child in node.children.items():
                assert child.parent is node, f"bad parent link at {child!r}"
                assert child.key[:ps] == first, f"child index key mismatch at {child!r}"
                child_locks += child.lock_ref
                stack.append(child)
            if node.parent is not None:
                # Each lock below counted once on this node, plus any locks taken on it directly.
                assert node.lock_ref >= child_locks, f"lock count below children's at {node!r}"
        assert evictable == self._evictable_pages, (evictable, self._evictable_pages)
        assert protected == self._protected_pages, (protected, self._protected_pages)
