"""Block keys that survive processes: a hash chain over the model's KV layout and token ids.

A block is one full page of KV (every layer, K and V). Its key is

    h_i = blake2b(namespace.digest || h_{i-1} || le_int32(tokens of page i), digest_size=16)

with h_{-1} = `parent` (sixteen zero bytes, `ROOT`, when the prefix starts at token 0). A key
therefore names a page *and everything before it*: equal keys mean equal prefixes, so a block found
under a key may be loaded into any request whose prefix hashes to it. The namespace digest puts the
model, dtype and page geometry into every key: a block written by another model, dtype or page size
can never be found, even in a shared directory. Nothing here uses Python's `hash()`, so keys are the
same in every process and across restarts.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

KEY_BYTES = 16
ROOT = bytes(KEY_BYTES)  # the parent of a prefix's first page
# Bumped when the key derivation changes: old blocks then become unreachable instead of wrong.
KEY_VERSION = 1
_INT32 = (-(2**31), 2**31 - 1)


@dataclass(frozen=True)
class Namespace:
    """What must match for a stored block to be reusable: the model and the KV page layout.

    `model` is a fingerprint of the weights (e.g. a hash of the checkpoint's config and files), not
    just a name: two fine-tunes of one architecture must not share blocks.
    """

    model: str
    dtype: str  # the KV dtype's name, e.g. "bfloat16"
    page_size: int
    num_layers: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("page_size", "num_layers", "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"Namespace.{name} must be >= 1, got {getattr(self, name)}")
        if not self.model or not self.dtype:
            raise ValueError("Namespace needs a model fingerprint and a dtype name")

    @cached_property
    def digest(self) -> bytes:
        """16 bytes: blake2b over the canonical JSON list [version, model, dtype, page_size,
        num_layers, kv_heads, head_dim] (compact separators, ASCII)."""
        fields = [KEY_VERSION, self.model, self.dtype, self.page_size, self.num_layers, self.kv_heads, self.head_dim]
        text = json.dumps(fields, separators=(",", ":"), ensure_ascii=True)
        return hashlib.blake2b(text.encode("ascii"), digest_size=KEY_BYTES).digest()

    @property
    def hex(self) -> str:
        return self.digest.hex()

    def block_bytes(self, itemsize: int) -> int:
        """Bytes of one block (a page across all layers, K and V) for a dtype of `itemsize` bytes."""
        return self.num_layers * 2 * self.page_size * self.kv_heads * self.head_dim * itemsize


def block_hash(namespace: Namespace, parent: bytes, page_tokens: Sequence[int]) -> bytes:
    """The key of one full page whose prefix hashes to `parent` (`ROOT` for the first page)."""
    if len(page_tokens) != namespace.page_size:
        raise ValueError(f"a block is one full page of {namespace.page_size} tokens, got {len(page_tokens)}")
    if len(parent) != KEY_BYTES:
        raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    try:
        packed = struct.pack(f"<{len(page_tokens)}i", *page_tokens)
    except struct.error as e:
        raise ValueError(f"token ids must fit in int32 {_INT32}: {e}") from None
    h = hashlib.blake2b(namespace.digest, digest_size=KEY_BYTES)
    h.update(parent)
    h.update(packed)
    return h.digest()


def block_hashes(namespace: Namespace, token_ids: Sequence[int], parent: bytes | None = None) -> list[bytes]:
    """One key per FULL page of `token_ids` (a trailing partial page has none), chained from
    `parent` (the key of the page just before `token_ids[0]`; None or `ROOT` at the prompt start)."""
    prev = ROOT if parent is None else parent
    ps = namespace.page_size
    keys = []
    for start in range(0, len(token_ids) - ps + 1, ps):
        prev = block_hash(namespace, prev, token_ids[start:start + ps])
        keys.append(prev)
    return keys


def key_hex(key: bytes) -> str:
    """The filename form of a key (32 lowercase hex digits)."""
    assert len(key) == KEY_BYTES, f"a block key is {KEY_BYTES} bytes, got {len(key)}"
    return key.hex()


def key_from_hex(text: str) -> bytes | None:
    """The key a filename stem names, or None if it is not one."""
    try:
        key = bytes.fromhex(text)
    except ValueError:
        return None
    # Canonical spelling only: fromhex also takes upper case and spaces, which would let two
    # filenames name one key.
    return key if len(key) == KEY_BYTES and key.hex() == text else None
