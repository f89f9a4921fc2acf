"""The router's view of every worker's prefix cache: an approximation from the prompts it routed.

Workers that publish KV events (Redis registry; services/router/kv_feed.py) are routed by their exact
views instead; this index answers for the others, and for text prompts. It needs no protocol and no
worker change, works the same with Redis, static and Kubernetes discovery, and is what SGLang's router does.
What it cannot see — pages a worker evicted under memory pressure, prompts another router sent — is
bounded instead: an entry expires `ttl_s` after the last prompt that used it, and a worker's view
holds at most as many blocks as the worker has KV pages (from its heartbeat), least recently used
out first. A wrong guess costs a little compute or balance, never correctness: the workers' own radix
caches decide what is reused.

Prompts are cut into blocks of `BLOCK_TOKENS` token ids (the workers' default page size), each named
by a hash chained over every block before it, so one set lookup per block finds the longest cached
prefix. Text prompts (SDK calls without token ids; the router has no tokenizer) are cut into blocks of
`BLOCK_TOKENS * CHARS_PER_TOKEN` bytes of UTF-8 in a separate key space. A LoRA adapter's prompt is
hashed under a key of its own (its name), as a worker caches it in a namespace of its own
(engine/lora/adapters.py `cache_key`): it never matches the base model's or another adapter's
blocks, and matches its own. Torch-free.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

BLOCK_TOKENS = 16
CHARS_PER_TOKEN = 4  # a rough length estimate of a text prompt in tokens


@dataclass(frozen=True)
class PromptKey:
    """A prompt as the router sees it: its estimated length in tokens and its chained block hashes."""

    num_tokens: int
    blocks: tuple[bytes, ...]
    # The prompt's token ids, for the exact view (KV events); None for a text prompt.
    token_ids: Sequence[int] | None = field(default=None, compare=False, repr=False)
    adapter: str = ""   # the LoRA adapter whose key space the blocks are in ("": the base model's)

    @classmethod
    def of(cls, token_ids: Sequence[int] | None = None, text: str = "", adapter: str = "") -> PromptKey:
        if token_ids is not None:
            data, unit, n = b"t" + b"".join(int(t).to_bytes(4, "little") for t in token_ids), 4, len(token_ids)
        else:
            raw = text.encode()
            data, unit, n = b"s" + raw, CHARS_PER_TOKEN, -(-len(raw) // CHARS_PER_TOKEN)
        size = BLOCK_TOKENS * unit
        space = data[:1] + (hashlib.blake2b(adapter.encode(), digest_size=16).digest() if adapter else b"")
        blocks, prev = [], b""
        # Only whole blocks: the tail of a prompt never counts as cached (as on a worker).
        for start in range(1, len(data) - size + 1, size):
            prev = hashlib.blake2b(prev + data[start:start + size], digest_size=12, key=space).digest()
            blocks.append(prev)
        return cls(n, tuple(blocks), token_ids, adapter)

    def tokens(self, num_blocks: int) -> int:
        """Prompt tokens covered by the first `num_blocks` blocks."""
        return min(self.num_tokens, num_blocks * BLOCK_TOKENS)


class PrefixCacheView:
    """Per worker: block hash -> when a routed prompt last used it, in LRU order."""

    def __init__(self, ttl_s: float = 300.0, default_capacity: int = 1 << 16,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.default_capacity = default_capacity
        self.clock = clock
        self._workers: dict[str, OrderedDict[bytes, float]] = {}

    def cached_tokens(self, worker_id: str, key: PromptKey) -> int:
        """Tokens of the prompt's longest prefix that `worker_id` is believed to hold."""
        blocks = self._workers.get(worker_id)
        if not blocks:
            return 0
        oldest = self.clock() - self.ttl_s
        n = 0
        for h in key.blocks:
            seen = blocks.get(h)
            if seen is None or seen < oldest:
                break
            n += 1
        return key.tokens(n)

    def record(self, worker_id: str, key: PromptKey, capacity: int = 0) -> None:
        """`worker_id` now holds the prompt's blocks. Touched deepest-first, so that eviction (oldest
        first) takes a prompt's tail before its head, as a worker's radix cache does."""
        blocks = self._workers.setdefault(worker_id, OrderedDict())
        now = self.clock()
        for h in reversed(key.blocks):
            blocks[h] = now
            blocks.move_to_end(h)
        self._trim(blocks, capacity or self.default_capacity, now)

    def retain(self, worker_ids: Iterable[str]) -> None:
        """Forget workers that left: a worker at the same id later starts with an empty cache."""
        live = set(worker_ids)
        for wid in [w for w in self._workers if w not in live]:
            del self._workers[wid]

    def size(self, worker_id: str) -> int:
        blocks = self._workers.get(worker_id)
        if blocks:
            self._trim(blocks, self.default_capacity, self.clock())
        return len(blocks or ())

    def _trim(self, blocks: OrderedDict[bytes, float], capacity: int, now: float) -> None:
        oldest = now - self.ttl_s
        while blocks:
            h, seen = next(iter(blocks.items()))
            if len(blocks) <= capacity and seen >= oldest:
                break
            del blocks[h]
