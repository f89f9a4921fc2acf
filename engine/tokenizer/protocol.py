"""The small surface of a tokenizer that the engine relies on (torch-free)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class TokenizerLike(Protocol):
    vocab_size: int
    eos_token_ids: frozenset[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]: ...
