"""The gateway's tokenizer: `tokenizers` on the model folder's tokenizer.json, no transformers or torch.

It must encode exactly like the workers' `engine.tokenizer.tokenizer.Tokenizer` (a transformers fast tokenizer
wraps the same tokenizer.json), because the gateway sends token ids, not text: the prompt is
tokenized once, and the usage it reports is what the model saw.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from tandem.services.gateway.chat_template import render

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or as an AddedToken dict.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    path = folder / "chat_template.jinja"  # transformers >= 4.43 saves it next to tokenizer_config.json
    if path.is_file():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template else None


class GatewayTokenizer:
    def __init__(self, tok: Tokenizer, chat_template: str | None, special_tokens: dict[str, str]):
        self._tok = tok
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self.token_text = lru_cache(maxsize=65536)(self._token_text)

    @classmethod
    def from_folder(cls, folder: str | Path) -> GatewayTokenizer:
        folder = Path(folder)
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        try:
            config = json.loads((folder / "tokenizer_config.json").read_text())
        except FileNotFoundError:
            config = {}
        special = {k: t for k in _SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}
        return cls(tok, _chat_template(folder, config), special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def _token_text(self, token_id: int) -> str:
        """One token as text, as OpenAI's logprobs show it (special tokens included)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            extra: dict[str, Any] | None = None) -> str:
        """Raises ValueError when the model has no template, ChatTemplateError when it refuses the messages."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use /v1/completions with a plain prompt")
        return render(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                      special_tokens=self.special_tokens, extra=extra)
