"""Render a model's Jinja chat template (torch-free), the way Hugging Face templates expect.

Templates are written against a sandboxed jinja2 environment with `trim_blocks` and `lstrip_blocks`,
the `loopcontrols` extension, a `tojson` filter that keeps non-ASCII text, and the globals
`raise_exception` and `strftime_now`; special tokens (`bos_token`, ...) are template variables.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template rejected the messages (its `raise_exception`) or failed to render."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the model's chat template does not compile: {e}") from e


def render(source: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
           special_tokens: dict[str, str], extra: dict[str, Any] | None = None) -> str:
    """The prompt text for `messages`; raises ChatTemplateError when the template refuses them."""
    variables = {**(extra or {}), **special_tokens, "messages": messages,
                 "add_generation_prompt": add_generation_prompt}
    try:
        return compile_template(source).render(**variables)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template rejected the messages: {e}") from e
