"""Import a llama-architecture GGUF checkpoint into a Hugging Face model folder.

The folder holds what `engine` and `transformers` load: `config.json`, `generation_config.json`,
`model.safetensors` (HF tensor names, float32), `tokenizer.json` and `tokenizer_config.json`
(with the GGUF's chat template), plus `tandem_import.json`, which records how it was made.

Weights are stored as float32: a dequantized Q4_1/Q8_0 value is exact in float32 and not in
bfloat16, so the folder reproduces the GGUF bit for bit and the engine picks its own run dtype.
The price is disk (~540 MB for SmolLM2-135M).

Neither torch nor transformers is needed here: `gguf` dequantizes, `tokenizers` builds the
tokenizer, `safetensors.numpy` writes the weights.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tqdm import tqdm

# Bump when the folder's layout or content changes, so caches made by older code get rebuilt.
IMPORTER_VERSION = 1
MARKER_FILE = "tandem_import.json"

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Control tokens that end a generation besides the declared eos (llama.cpp treats them the same way):
# SmolLM2-Instruct may close a plain completion with <|endoftext|> rather than <|im_end|>.
_END_OF_GENERATION_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
# The sampling defaults llama.cpp's converter copies from a model's generation_config.json into the
# GGUF (gguf-py's Metadata.load), back to their generation_config.json names. Only what the authors
# published travels: a GGUF without them (SmolLM2-135M-Instruct's) gives a generation_config.json
# without them. penalty_repeat is left out: llama.cpp's penalty covers the last N tokens, not HF's whole text.
_GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                  "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p"}


def import_gguf(
    gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, progress: bool = True
) -> Path:
    """Convert the GGUF file at `gguf_path` into a new HF model folder at `out_dir`; return it.

    The folder appears atomically (written beside it under a temporary name, then renamed), so
    `out_dir` either does not exist or is complete. `out_dir` must not exist yet (FileExistsError).
    Raises ValueError for a GGUF this importer does not support (non-llama architecture, a tensor
    it cannot name).
    """
    src = Path(gguf_path)
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} already exists; remove it first")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        reader = gguf.GGUFReader(src)
        meta = _Metadata(reader)
        config = _model_config(meta, {t.name for t in reader.tensors})
        tensors = _convert_tensors(reader, config, progress=progress, desc=f"importing {src.name}")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "model.safetensors").chmod(0o644)  # safetensors creates it 0600; the cache may be shared
        del tensors
        _write_json(tmp / "config.json", config)
        _write_tokenizer(meta, config, tmp)
        _write_json(tmp / "generation_config.json", _generation_config(meta, config))
        marker = {
            "importer_version": IMPORTER_VERSION,
            "source": src.name,
            "source_bytes": src.stat().st_size,
        }
        _write_json(tmp / MARKER_FILE, marker)
        _fsync_tree(tmp)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (rows of each head reordered for its rope layout).

    llama.cpp's converter maps HF rows `(head, half, i)` to `(head, i, half)`; this maps them back.
    Works on a 2-D weight `[n_head * head_dim, in]` or a 1-D bias.
    """
    rows = weight.shape[0]
    assert rows % (2 * n_head) == 0, f"{rows} rows do not split into {n_head} heads of even size"
    head_dim = rows // n_head
    rest = weight.shape[1:]
    return weight.reshape(n_head, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


class _Metadata:
    """Typed access to the GGUF key/value header."""

    _MISSING = object()

    def __init__(self, reader: gguf.GGUFReader):
        self._fields = reader.fields

    def get(self, key: str, default: Any = _MISSING) -> Any:
        field = self._fields.get(key)
        if field is None:
            if default is self._MISSING:
                raise ValueError(f"GGUF metadata lacks {key!r}")
            return default
        return field.contents()


def _model_config(meta: _Metadata, tensor_names: set[str]) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only 'llama' is)")
    hidden = int(meta.get("llama.embedding_length"))
    n_head = int(meta.get("llama.attention.head_count"))
    n_kv_head = int(meta.get("llama.attention.head_count_kv", n_head))
    head_dim = int(meta.get("llama.attention.key_length", hidden // n_head))
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(
            f"partial rotary embeddings (rope dim {rope_dim} != head dim {head_dim}) are unsupported"
        )
    if meta.get("llama.rope.scaling.type", "none") != "none" or "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF rope scaling is unsupported")
    vocab = int(meta.get("llama.vocab_size", len(meta.get("tokenizer.ggml.tokens"))))
    eos = int(meta.get("tokenizer.ggml.eos_token_id"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta.get("llama.feed_forward_length")),
        "num_hidden_layers": int(meta.get("llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv_head,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get("llama.context_length")),
        "rms_norm_eps": float(meta.get("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "vocab_size": vocab,
        "bos_token_id": int(meta.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": eos,
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", eos)),
        "initializer_range": 0.02,
        "use_cache": True,
        # The dtype the model was trained in; the weights in this folder are float32 (see module doc).
        "torch_dtype": "bfloat16",
    }


def _hf_name(gguf_name: str) -> str:
    base, _, kind = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part in _LAYER_NAMES:
            return f"model.layers.{int(layer)}.{_LAYER_NAMES[part]}.{kind}"
    elif base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face llama equivalent")


def _convert_tensors(
    reader: gguf.GGUFReader, config: dict[str, Any], *, progress: bool, desc: str
) -> dict[str, np.ndarray]:
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc=desc, unit="tensor", disable=not progress):
        # dequantize returns torch order ([out, in]); np.array copies off the read-only mmap.
        w = np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
        expected = tuple(int(d) for d in reversed(t.shape))
        assert w.shape == expected, f"{t.name}: dequantized {w.shape}, header says {expected}"
        part = t.name.split(".")[-2]
        if part in heads:
            w = unpermute_qk(w, heads[part])
        out[_hf_name(t.name)] = np.ascontiguousarray(w)
    return out


def _build_tokenizer(meta: _Metadata) -> HFTokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE 'gpt2' is)")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type", [gguf.TokenType.NORMAL] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # llama.cpp's "smollm"/"starcoder" pre-tokenizers split every digit off before the GPT-2 regex.
    if meta.get("tokenizer.ggml.pre", "default") in ("smollm", "starcoder", "refact", "codeshell"):
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [i for i, ty in enumerate(types) if ty == gguf.TokenType.CONTROL]
    user = [i for i, ty in enumerate(types) if ty == gguf.TokenType.USER_DEFINED]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in specials])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
    for i in specials + user:
        assert tok.token_to_id(tokens[i]) == i, f"added token {tokens[i]!r} moved off id {i}"
    return tok


def _write_tokenizer(meta: _Metadata, config: dict[str, Any], out: Path) -> None:
    tok = _build_tokenizer(meta)
    if meta.get("tokenizer.ggml.add_bos_token", False) or meta.get("tokenizer.ggml.add_eos_token", False):
        raise ValueError("GGUF tokenizers that add bos/eos on encode are unsupported")
    tok.save(str(out / "tokenizer.json"))
    tokens = meta.get("tokenizer.ggml.tokens")

    def text(key: str) -> str | None:
        idx = meta.get(key, None)
        return None if idx is None else tokens[int(idx)]

    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text("tokenizer.ggml.bos_token_id"),
        "eos_token": text("tokenizer.ggml.eos_token_id"),
        "unk_token": text("tokenizer.ggml.unknown_token_id"),
        "pad_token": text("tokenizer.ggml.padding_token_id"),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    template = meta.get("tokenizer.chat_template", None)
    if template is not None:
        tok_config["chat_template"] = template
    _write_json(out / "tokenizer_config.json", tok_config)


def _generation_config(meta: _Metadata, config: dict[str, Any]) -> dict[str, Any]:
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type", [])
    eos = [config["eos_token_id"]]
    eot = meta.get("tokenizer.ggml.eot_token_id", None)
    if eot is not None:
        eos.append(int(eot))
    for i, ty in enumerate(types):
        if ty == gguf.TokenType.CONTROL and tokens[i] in _END_OF_GENERATION_TEXTS:
            eos.append(i)
    eos = list(dict.fromkeys(eos))
    sampling = {name: meta.get(key) for key, name in _GGUF_SAMPLING.items() if meta.get(key, None) is not None}
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eos if len(eos) > 1 else eos[0],
        "pad_token_id": config["pad_token_id"],
        **{name: round(float(v), 6) if name != "top_k" else int(v) for name, v in sampling.items()},
    }


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _fsync_tree(folder: Path) -> None:
    # Data must be on disk before the rename publishes the folder, or a power cut could leave a
    # complete-looking folder of empty files.
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
