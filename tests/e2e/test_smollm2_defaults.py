"""The first thing a newcomer asks, with the defaults (bf16), through the HTTP gateway, in every mode
(slow: a SmolLM2 stack per mode)."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.stack import Stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODES = {
    "colocated": ("--mode", "colocated"),
    "1p1d-shm": ("--transfer-backend", "shm"),
    "1p1d-tcp": ("--transfer-backend", "tcp"),
}
# The README's and examples/' prompts (examples/curl.sh, openai_client.py, sdk_async.py).
CHAT = ["What is the capital of France?", "Write a haiku about the sea."]
COMPLETIONS = ["The capital of France is", "The largest planet is", "Water boils at", "Once upon a time"]


def ask(url: str) -> dict[str, str]:
    """Each prompt sent alone (greedy, so equal batches give equal text in every mode)."""
    out = {}
    with httpx.Client(base_url=url, timeout=120) as c:
        for q in CHAT:
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": q}],
                                                     "max_tokens": 32, "temperature": 0})
            assert r.status_code == 200, r.text
            out[q] = r.json()["choices"][0]["message"]["content"]
        for p in COMPLETIONS:
            r = c.post("/v1/completions", json={"prompt": p, "max_tokens": 16, "temperature": 0})
            assert r.status_code == 200, r.text
            out[p] = r.json()["choices"][0]["text"]
    return out


def test_defaults_answer_sensibly_and_alike_in_every_mode():
    answers = {}
    for mode, args in MODES.items():
        stack = Stack("--model", "smollm2-135m", "--kv-cache-gb", "0.25", *args, gateway=True)
        try:
            answers[mode] = ask(stack.gateway_url)
        finally:
            stack.close()
    colocated = answers["colocated"]
    assert colocated["What is the capital of France?"].startswith("The capital of France is Paris")
    assert "Paris" in colocated["The capital of France is"]
    for mode, got in answers.items():
        assert got == colocated, f"{mode} differs from co-located"
