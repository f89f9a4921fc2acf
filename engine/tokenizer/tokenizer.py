"""The engine's tokenizer: a thin wrapper over a local Hugging Face fast tokenizer."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from transformers import AutoTokenizer

from tandem.engine.errors import InvalidRequest


class Tokenizer:
    """Implements `engine.tokenizer.protocol.TokenizerLike` for an HF model folder (offline).

    `eos_token_ids` is every id that ends a generation: the tokenizer's eos token plus the
    `eos_token_id` (int or list) of `generation_config.json` when the folder has one.
    """

    def __init__(self, path: str | os.PathLike[str]):
        folder = Path(path)
        self._tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        assert self._tok.is_fast, f"{folder} has no fast tokenizer (tokenizer.json)"
        self.vocab_size: int = len(self._tok)
        self.bos_token_id: int | None = self._tok.bos_token_id
        eos: set[int] = set()
        if self._tok.eos_token_id is not None:
            eos.add(self._tok.eos_token_id)
        eos.update(_generation_eos_ids(folder / "generation_config.json"))
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens(list(ids))

    @property
    def has_chat_template(self) -> bool:
        return bool(self._tok.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) into the prompt text.

        Raises InvalidRequest (param "messages") when the model has no chat template or the
        messages are malformed or rejected by the template.
        """
        if not self.has_chat_template:
            raise InvalidRequest("this model has no chat template; send a plain prompt instead", "messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages must be a non-empty list", "messages")
        for i, m in enumerate(messages):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise InvalidRequest(
                    f"messages[{i}] must have a string 'role' and a string 'content'", "messages"
                )
        try:
            return self._tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except jinja2.TemplateError as e:  # templates reject e.g. a bad role order with raise_exception
            raise InvalidRequest(f"chat template rejected the messages: {e}", "messages") from e


def _generation_eos_ids(path: Path) -> set[int]:
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except FileNotFoundError:
        return set()
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}
