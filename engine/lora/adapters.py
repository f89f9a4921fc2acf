"""LoRA adapters in the format users have (PEFT's `adapter_config.json` + `adapter_model.safetensors`),
loaded and checked against the model they are for.

An adapter adds `scaling * (x @ A.T) @ B.T` to the output of a projection (A: `[r, in]`, B: `[out, r]`,
scaling `lora_alpha / r`, or `/ sqrt(r)` with `use_rslora`). Tandem fuses q/k/v into `qkv_proj` and
gate/up into `gate_up_proj`, so each adapted projection becomes a slice of a fused output: `blocks`
maps (layer, fused projection) to one (A, B) pair of all its adapted parts. Targets: the
attention and MLP projections (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`,
`down_proj`). What PEFT can save but this does not apply is refused at load with a message that
says so (DoRA, `modules_to_save`, per-module rank or alpha patterns, biases, embeddings, `fan_in_fan_out`),
as is a rank above `--max-lora-rank` or a tensor whose shape does not fit the model.

Identity: `digest` (SHA-256 of the config and the weights) names an adapter's content wherever its KV
could be reused: its requests have a prefix-cache namespace of their own (radix_cache.py), whose key
(`cache_key`) starts the chain of their block keys (tiers, KV events), and D sends it to P in the
bootstrap: two adapters never share KV; two requests of one adapter do.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.engine.errors import InvalidRequest
from tandem.engine.models.config import ModelConfig

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# PEFT's module name -> (Tandem's fused projection, which part of it)
TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    digest: str
    # (layer, fused projection) -> (A [k*r, in], B [fused out, k*r]): the k adapted parts in one pair,
    # B placed at each part's output rows and scaled: the delta is (x @ A.T) @ B.T (batch.py)
    blocks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    # (layer, fused projection) -> each part's (first output row, output rows), in the order of its
    # rank columns in the block (q/k/v, gate/up); absent: one part over every output (registry.py Stack)
    parts: dict[tuple[int, str], tuple[tuple[int, int], ...]] = field(default_factory=dict, repr=False)

    @property
    def cache_key(self) -> bytes:
        """The adapter's namespace in the KV block keys (16 bytes of its digest): the parent key of its
        prompts' first pages, so no block key of it equals one of the base model or another adapter."""
        return bytes.fromhex(self.digest)[:16]


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """PEFT module -> (in features, out features, offset in the fused output)."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"q_proj": (h, q, 0), "k_proj": (h, kv, q), "v_proj": (h, kv, q + kv), "o_proj": (q, h, 0),
            "gate_proj": (h, inter, 0), "up_proj": (h, inter, inter), "down_proj": (inter, h, 0)}


def _config(path: Path, name: str, max_rank: int) -> tuple[dict, int, float]:
    param = f"lora adapter {name!r}"
    try:
        cfg = json.loads((path / CONFIG).read_text())
    except FileNotFoundError:
        raise InvalidRequest(f"{param}: no {CONFIG} in {path}", "lora_path") from None
    except ValueError as e:
        raise InvalidRequest(f"{param}: {CONFIG} is not valid JSON: {e}", "lora_path") from None
    if not isinstance(cfg, dict) or str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise InvalidRequest(f"{param}: not a LoRA adapter (peft_type {cfg.get('peft_type')!r})", "lora_path")
    unsupported = [what for what, bad in (
        ("DoRA (use_dora)", cfg.get("use_dora")), ("modules_to_save", cfg.get("modules_to_save")),
        ("per-module ranks (rank_pattern)", cfg.get("rank_pattern")),
        ("per-module alphas (alpha_pattern)", cfg.get("alpha_pattern")),
        (f"bias={cfg.get('bias')!r}", cfg.get("bias", "none") not in ("none", None)),
        ("fan_in_fan_out", cfg.get("fan_in_fan_out")), ("layers_to_transform", cfg.get("layers_to_transform")),
    ) if bad]
    if unsupported:
        raise InvalidRequest(f"{param}: not supported: {', '.join(unsupported)}", "lora_path")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise InvalidRequest(f"{param}: rank r={r!r} is not a positive integer", "lora_path")
    if r > max_rank:
        raise InvalidRequest(f"{param}: rank {r} is above --max-lora-rank {max_rank}", "lora_path")
    alpha = cfg.get("lora_alpha", r)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise InvalidRequest(f"{param}: lora_alpha {alpha!r} is not a number", "lora_path")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return cfg, r, float(scaling)


def check_adapter(name: str, path: str | Path, max_rank: int) -> None:
    """What can be checked without reading the weights (a lazily loaded adapter, at registration):
    its config, and that the weights file is there. Raises InvalidRequest (param `lora_path`)."""
    path = Path(path)
    _config(path, name, max_rank)
    if not (path / WEIGHTS).is_file():
        raise InvalidRequest(f"lora adapter {name!r}: no {WEIGHTS} in {path}", "lora_path")


def load_adapter(name: str, path: str | Path, model_cfg: ModelConfig, *, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> LoraAdapter:
    """Read and check the PEFT adapter in folder `path`. Raises InvalidRequest (param `lora_path`)
    saying what is wrong with it."""
    from safetensors import safe_open

    path = Path(path)
    param = f"lora adapter {name!r}"
    cfg, rank, scaling = _config(path, name, max_rank)
    weights = path / WEIGHTS
    if not weights.is_file():
        raise InvalidRequest(f"{param}: no {WEIGHTS} in {path}", "lora_path")
    digest = hashlib.sha256((path / CONFIG).read_bytes() + weights.read_bytes()).hexdigest()
    shapes = _shapes(model_cfg)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights), framework="pt") as f:
            for key in f.keys():   # noqa: SIM118 - safe_open is not a dict
                m = _KEY.match(key)
                if m is None or m.group(2) not in TARGETS or int(m.group(1)) >= model_cfg.num_layers:
                    raise InvalidRequest(f"{param}: tensor {key!r} is not a LoRA weight of an attention or MLP "
                                         f"projection of this {model_cfg.num_layers}-layer model", "lora_path")
                parts.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = f.get_tensor(key)
    except InvalidRequest:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged file is the user's input
        raise InvalidRequest(f"{param}: cannot read {WEIGHTS}: {e}", "lora_path") from None
    if not parts:
        raise InvalidRequest(f"{param}: {WEIGHTS} holds no LoRA weights", "lora_path")
    mods: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), ab in sorted(parts.items()):
        a, b = ab.get("A"), ab.get("B")
        n_in, n_out, offset = shapes[module]
        if a is None or b is None:
            raise InvalidRequest(f"{param}: layer {layer} {module} has lora_{'A' if a is None else 'B'} missing",
                                 "lora_path")
        if tuple(a.shape) != (rank, n_in) or tuple(b.shape) != (n_out, rank):
            raise InvalidRequest(f"{param}: layer {layer} {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not "
                                 f"fit rank {rank} and this model's {n_in} -> {n_out}", "lora_path")
        fused, _ = TARGETS[module]
        mods.setdefault((layer, fused), []).append(
            (offset, a.to(device=device, dtype=dtype).contiguous(), b.to(device=device, dtype=dtype).contiguous()))
    fused_out = {"qkv_proj": model_cfg.q_size + 2 * model_cfg.kv_size, "o_proj": model_cfg.hidden_size,
                 "gate_up_proj": 2 * model_cfg.intermediate_size, "down_proj": model_cfg.hidden_size}
    blocks, parts_of = {}, {}
    for key, parts_ in mods.items():
        a = torch.cat([a for _, a, _ in parts_])
        b = torch.zeros(fused_out[key[1]], a.shape[0], dtype=dtype, device=device)
        for i, (offset, _, part_b) in enumerate(parts_):
            b[offset:offset + part_b.shape[0], i * rank:(i + 1) * rank] = part_b * scaling
        blocks[key] = (a.contiguous(), b.contiguous())
        parts_of[key] = tuple((offset, part_b.shape[0]) for offset, _, part_b in parts_)
    return LoraAdapter(name, str(path), rank, scaling, digest, blocks, parts_of)
