"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm).

Tokens of every sequence in a step are flattened into one `[T]` batch: the linear layers see one
matrix, and only attention (behind `AttentionBackend`) knows where sequences start and end.
Q/K/V and gate/up projections are fused into one matmul each; `load_weights` stacks the Hugging Face
tensors into them.

Precision: in bf16/fp16 the matmuls, attention and KV cache run in the model dtype, while the
residual stream, the norms, RoPE and the logits of the top candidates stay fp32 (see
`engine.models.logits`). Rounding the residual sum to bf16 after every block is where most of a
bf16 forward's drift from fp32 comes from; keeping it wide costs one fp32 `[T, hidden]` add per
block. Measured on SmolLM2 (14 chat and completion prompts, 40 teacher-forced tokens each): the
greedy token agrees with the fp32 model at 97.5% of positions with a bf16 residual and bf16 logits
(Hugging Face's bf16: 97.7%), 99.6% with both fp32.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tandem.engine.forward_context import ForwardContext
from tandem.engine.models.config import ModelConfig
from tandem.engine.models.layers import RMSNorm, SiluAndMul
from tandem.engine.models.logits import compute_logits
from tandem.engine.models.prepack import PanelEmbedding, linear_packer, prepack_linears
from tandem.engine.models.rope import RotaryEmbedding


class Attention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = torch.nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = torch.nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.cpu_ops = None   # fused CPU kernels for RoPE (engine.models.layers.use_cpu_kernels)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if ctx.lora is not None:
            ctx.lora.apply(self.layer_id, "qkv_proj", x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(cos_sin, q, k, self.cpu_ops)
        out = ctx.attn.forward(self.layer_id, q, k, v, ctx).reshape(-1, self.q_size)
        y = self.o_proj(out)
        if ctx.lora is not None:
            ctx.lora.apply(self.layer_id, "o_proj", out, y)
        return y


class MLP(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int = 0):
        super().__init__()
        self.layer_id = layer_id
        self.gate_up_proj = torch.nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        lora = ctx.lora if ctx is not None else None
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.apply(self.layer_id, "gate_up_proj", x, gate_up)
        h = self.act(gate_up)
        y = self.down_proj(h)
        if lora is not None:
            lora.apply(self.layer_id, "down_proj", h, y)
        return y


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = MLP(cfg, layer_id)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x.float(), self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_forward(x, residual)
        x = self.self_attn(x, ctx, cos_sin)
        x, residual = self.post_attention_layernorm.add_forward(x, residual)
        return self.mlp(x, ctx), residual


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = torch.nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)
        self.lm_head = None if cfg.tie_word_embeddings else torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.vocab_projection: torch.nn.Module | None = None   # packed copy of the vocab projection (prepack())

    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        """Returns fp32 logits `[len(ctx.logits_indices), vocab]` for the positions that sample."""
        x = self.embed_tokens(ctx.input_ids)
        residual = None
        cos_sin = self.rope.lookup(ctx.positions)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, ctx, cos_sin)
            if ctx.after_layer is not None:
                ctx.after_layer(i)
        # Only the last position of each sampling sequence needs the (large) vocab projection.
        h = self.norm.forward_fp32((x + residual).index_select(0, ctx.logits_indices))
        return compute_logits(h, self._vocab_weight(), self.vocab_projection)

    def _vocab_weight(self) -> torch.Tensor | None:
        """The plain vocab projection weight; None once the packed one is the only copy (fp32 prepack)."""
        owner = self.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head
        return getattr(owner, "weight", None)

    def prepack(self, ops=None) -> int:
        """Decoder projections on packed weights (engine/models/prepack.py): oneDNN's layout in bf16,
        the panel layout of Tandem's fp32 kernel with `ops` (kernels.cpu). The vocab projection is
        packed too. In bf16 its plain weight stays (the embedding and the fp32 rescoring of the top
        candidates read its rows); in fp32 the packed weight is the only copy: a tied embedding reads
        its rows from the panels, an untied lm_head is dropped. Returns how many layers were packed."""
        self.vocab_projection = linear_packer(ops)(self._vocab_weight(), None)
        if ops is not None:
            if self.cfg.tie_word_embeddings:
                self.embed_tokens = PanelEmbedding(self.vocab_projection)
            else:
                self.lm_head = None
        return prepack_linears(self.layers, ops) + 1

    # --- weights -----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into this module, stacking q/k/v and gate/up.

        Raises ValueError naming any parameter that the checkpoint left unset or any tensor it
        has that this model does not know (a silent mismatch would generate garbage).
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        cfg = self.cfg
        offsets = {
            "q_proj": (0, cfg.q_size),
            "k_proj": (cfg.q_size, cfg.kv_size),
            "v_proj": (cfg.q_size + cfg.kv_size, cfg.kv_size),
            "gate_proj": (0, cfg.intermediate_size),
            "up_proj": (cfg.intermediate_size, cfg.intermediate_size),
        }
        fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                 "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
        unknown = []
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints still store a copy
            parts = name.split(".")
            target, rows = name, None
            for i, part in enumerate(parts):
                if part in fused:
                    parts[i] = fused[part]
                    target, rows = ".".join(parts), offsets[part]
                    break
            param = params.get(target)
            if param is None:
                unknown.append(name)
                continue
            with torch.no_grad():
                if rows is None:
                    if param.shape != tensor.shape:
                        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
                    param.copy_(tensor)
                    loaded.add(target)
                else:
                    start, size = rows
                    if tensor.shape[0] != size:
                        raise ValueError(f"{name}: checkpoint has {tensor.shape[0]} rows, expected {size}")
                    param[start:start + size].copy_(tensor)
                    loaded.add(f"{target}[{start}]")
        if unknown:
            raise ValueError(f"checkpoint tensors unknown to {cfg.architecture}: {unknown[:5]}")
        expected = set()
        for pname in params:
            if pname.endswith("qkv_proj.weight") or pname.endswith("qkv_proj.bias"):
                expected |= {f"{pname}[0]", f"{pname}[{cfg.q_size}]", f"{pname}[{cfg.q_size + cfg.kv_size}]"}
            elif pname.endswith("gate_up_proj.weight"):
                expected |= {f"{pname}[0]", f"{pname}[{cfg.intermediate_size}]"}
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {missing[:5]}")
