"""Random-weight model folders made on the machine that runs them (real weights cannot travel).

`make_random_llama` writes a Llama-family HF folder of any shape straight from random tensors (no
transformers model is built, so a 135M-parameter folder takes seconds): config.json in the hub's
spelling, model.safetensors, generation_config.json and a word-level tokenizer whose vocabulary
fills vocab_size exactly. SMOLLM2_SHAPE is SmolLM2-135M's shape (shared/FACTS.md), for timings that
mean something; the tests' tiny models (tests/fixtures/tiny_models.py) are for agreement checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=2048,
                     rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")     # pad 0, bos 1, eos 2, as the tiny models


def llama_tensors(shape: dict, dtype: torch.dtype, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """HF Llama parameter names and shapes, filled N(0, std); norm weights near 1."""
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    hd = shape.get("head_dim") or h // heads
    g = torch.Generator().manual_seed(seed)

    def rand(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=g) * std).to(dtype)

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)

    t = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": norm()}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({
            p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": rand(heads * hd, h), p + "self_attn.k_proj.weight": rand(kv_heads * hd, h),
            p + "self_attn.v_proj.weight": rand(kv_heads * hd, h), p + "self_attn.o_proj.weight": rand(h, heads * hd),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        })
    if not shape.get("tie_word_embeddings", False):
        t["lm_head.weight"] = rand(vocab, h)
    return t


def word_tokenizer(vocab_size: int, model_max_length: int):
    """A whitespace word-level tokenizer with exactly `vocab_size` tokens: the special ones, then w3, w4, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIAL[0], unk_token=SPECIAL[0],
                                  bos_token=SPECIAL[1], eos_token=SPECIAL[2], model_max_length=model_max_length)


def make_random_llama(out: Path, shape: dict = SMOLLM2_SHAPE, dtype: torch.dtype = torch.bfloat16,
                      seed: int = 0) -> Path:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "attention_bias": False, "rope_scaling": None, "torch_dtype": str(dtype).removeprefix("torch."),
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **shape}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n")
    save_file(llama_tensors(shape, dtype, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    word_tokenizer(shape["vocab_size"], shape["max_position_embeddings"]).save_pretrained(out)
    return out
