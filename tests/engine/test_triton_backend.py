"""The triton attention backend generates the same greedy tokens as the torch backend.

Without a GPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set before any
kernel module is imported), so the shapes stay tiny.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tandem.engine.attention.base import create_backend  # noqa: E402
from tandem.engine.kvcache.kv_pool import KVPool, KVPoolSpec  # noqa: E402
from tests.engine.test_engine_vs_hf import greedy, make_engine, random_prompts  # noqa: E402


def run_backend(backend, path, batches, n, **kw):
    """Greedy results for each batch of prompts, the batches run one after another (so later ones
    can hit the prefix cache): [(token_ids, cached_tokens)] per prompt."""
    engine = make_engine(path, attention_backend=backend, **kw)
    assert engine.runner.attn.name == backend
    out = [(r.token_ids, r.usage.cached_tokens)
           for batch in batches for r in engine.generate(batch, greedy(n))]
    engine.check_idle()
    return out


@pytest.mark.parametrize("kv_layout", ["page_first", "layer_first"])
def test_batch_of_odd_lengths_matches_torch(tiny_llama, kv_layout):
    # Lengths 1, 4 (one whole page), 7 and 18 (crossing pages); decode runs them as one batch.
    batches = [random_prompts([1, 4, 7, 18], 512, seed=5)]
    expected = run_backend("torch", tiny_llama, batches, 6, kv_layout="layer_first")
    assert run_backend("triton", tiny_llama, batches, 6, kv_layout=kv_layout) == expected


def test_prefix_hit_and_chunked_prefill_match_torch(tiny_llama):
    # Chunks of 8 tokens: later chunks attend to a paged prefix; the second prompt then finds the
    # first one's 3 whole pages in the prefix cache.
    [shared] = random_prompts([13], 512, seed=6)
    batches = [[shared + [5, 6, 7]], [shared + [9, 10]]]
    expected = run_backend("torch", tiny_llama, batches, 4, chunked_prefill_size=8)
    actual = run_backend("triton", tiny_llama, batches, 4, chunked_prefill_size=8)
    assert actual == expected
    assert actual[1][1] == 12


def test_auto_picks_torch_on_cpu_and_triton_on_cuda():
    spec = KVPoolSpec(num_layers=1, num_pages=4, page_size=4, kv_heads=1, head_dim=16, dtype=torch.float32)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = create_backend("auto", KVPool(spec, device), num_heads=2, head_dim=16)
    assert backend.name == ("triton" if device == "cuda" else "torch")


def test_cpu_without_interpreter_is_a_clear_error_and_torch_never_imports_triton():
    code = textwrap.dedent("""
        import sys, torch
        from tandem.engine.attention.base import create_backend
        from tandem.engine.kvcache.kv_pool import KVPool, KVPoolSpec
        pool = KVPool(KVPoolSpec(1, 4, 4, 1, 16, torch.float32), "cpu")
        assert create_backend("auto", pool, 2, 16).name == "torch"
        assert "triton" not in sys.modules
        try:
            create_backend("triton", pool, 2, 16)
        except ValueError as e:
            print("ERR", e)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERR" in out.stdout and "TRITON_INTERPRET=1" in out.stdout


def test_bf16_agrees_with_hf_bf16(tiny_llama):
    # The precision rules (fp32 residual stream, fp32 top logits) hold whatever the attention
    # backend; the interpreter rounds the kernels' bf16 stores by truncation, which the tie rule
    # of test_bf16_parity absorbs.
    from transformers import AutoModelForCausalLM

    from tests.engine.test_bf16_parity import TINY_LOGIT_RTOL, check_same_until_tie

    hf32 = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).eval()
    engine = make_engine(tiny_llama, attention_backend="triton", dtype="bfloat16")
    prompts = random_prompts([1, 7, 18], 512, seed=3)
    for prompt, res in zip(prompts, engine.generate(prompts, greedy(6)), strict=True):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()
        check_same_until_tie(hf32, prompt, res.token_ids, ref, TINY_LOGIT_RTOL)
    engine.check_idle()
