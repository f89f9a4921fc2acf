"""What the engine needs to know about a model, read from its Hugging Face `config.json`, and the
sampling defaults its authors recommend in `generation_config.json` (torch-free: the gateway reads
them too)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.engine.errors import InvalidRequest, ModelNotFound
from tandem.engine.models.registry import ARCHITECTURES
from tandem.engine.sampling_params import MODEL_DEFAULT_FIELDS, SamplingDefaults

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"

@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    path: str
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope: RopeConfig = field(default_factory=RopeConfig)
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V, all layers, for one token."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelNotFound(f"no config.json in model folder {path}")
        return cls.from_dict(json.loads(cfg_file.read_text()), str(path))

    @classmethod
    def from_dict(cls, d: dict[str, Any], path: str = "") -> ModelConfig:
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise ModelNotFound(
                f"unsupported architecture {arch!r}; supported: {sorted(ARCHITECTURES)}"
            )
        family = ARCHITECTURES[arch]
        num_heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        head_dim = d.get("head_dim") or hidden // num_heads
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        qkv_bias = bool(d.get("attention_bias", family.qkv_bias)) or family.qkv_bias
        return cls(
            path=path,
            architecture=arch,
            hidden_size=hidden,
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=d["intermediate_size"],
            vocab_size=d["vocab_size"],
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=family.qk_norm,
            rope=_rope_from_dict(d),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _rope_from_dict(d: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older folders use
    # `rope_theta` plus an optional `rope_scaling` dict.
    params = dict(d.get("rope_parameters") or {})
    scaling = d.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "llama3", "linear"):
        raise ModelNotFound(f"unsupported rope_type {rope_type!r}")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", d.get("max_position_embeddings", 8192))
        ),
    )


def generation_defaults(path: str | Path) -> dict[str, float | int]:
    """The sampling values (of MODEL_DEFAULT_FIELDS) that the model folder's generation_config.json
    sets; {} without the file. A value no request could carry either (temperature 5, top_p 0, a
    string) is left out with a warning: the model still serves, with Tandem's default for it."""
    file = Path(path) / GENERATION_CONFIG
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("%s is unreadable (%s): no sampling defaults from it", file, e)
        return {}
    out: dict[str, float | int] = {}
    for name in MODEL_DEFAULT_FIELDS:
        value = config.get(name) if isinstance(config, dict) else None
        if value is None:
            continue
        try:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidRequest(f"{name} must be a number, got {value!r}", name)
            if name == "top_k":
                if value != int(value):
                    raise InvalidRequest(f"top_k must be an integer, got {value!r}", name)
                value = int(value)
            SamplingDefaults().with_model({name: value})
        except InvalidRequest as e:
            log.warning("%s: %s; ignored (Tandem's default applies)", file, e)
            continue
        out[name] = value
    return out


def load_sampling_defaults(path: str | Path, base: SamplingDefaults = SamplingDefaults()) -> SamplingDefaults:
    """`base` with the model folder's recommendations over it, said once in the log: a warning when the
    model changes them (as vLLM does), so that nobody is surprised that an unset temperature is not
    the usual one."""
    defaults = base.with_model(generation_defaults(path))
    if defaults.from_model:
        log.warning("sampling defaults of requests that do not set them: %s", defaults.describe())
    else:
        log.info("sampling defaults of requests that do not set them: %s", defaults.describe())
    return defaults
