"""`cd /tmp && <checkout>/.venv/bin/tandem up` as a user runs it: the installed console script, a
working directory outside the checkout, no PYTHONPATH, Hugging Face's `kernels` installed (as
transformers 5.x requires). The stack serves a chat request over HTTP and one through the SDK.

This is what broke on a fresh clone when the checkout's top-level `kernels/` shadowed (or was
shadowed by) the `kernels` distribution: every worker died at import."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import httpx
import pytest
from tandem_client import Client

from tests.e2e.stack import ROOT, Stack, service_env

pytestmark = pytest.mark.timeout(300)

SCRIPT = Path(sys.executable).with_name("tandem")


@pytest.mark.skipif(not SCRIPT.exists(), reason="no installed `tandem` console script beside this Python")
def test_installed_tandem_up_from_another_directory_serves_chat_and_sdk(tmp_path):
    # The situation of the bug: both a `kernels` distribution and the checkout's kernels/ folder exist.
    assert importlib.metadata.distribution("kernels").metadata["Name"] == "kernels"
    assert (ROOT / "kernels").is_dir()
    env = {k: v for k, v in service_env().items() if k != "PYTHONPATH"}
    stack = Stack("--model", "smollm2-135m", "--mode", "colocated", "--kv-cache-gb", "0.25", gateway=True,
                  launcher=[str(SCRIPT)], cwd=tmp_path, env=env, timeout_s=240)
    try:
        with httpx.Client(base_url=stack.gateway_url, timeout=120) as c:
            r = c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        with Client(stack.info["router"], timeout=120) as client:
            result = client.generate("The capital of France is", max_tokens=8, temperature=0)
        assert "Paris" in result.text
    finally:
        stack.close()
