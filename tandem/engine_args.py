"""Command-line flags for EngineConfig, shared by every subcommand that runs a model."""

from __future__ import annotations

import argparse
import dataclasses

from engine.config import DTYPES, EngineConfig


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--model", default=d.model, help="alias (smollm2-135m) or a local Hugging Face folder")
    p.add_argument("--dtype", default=d.dtype, choices=DTYPES,
                   help="weights, activations and KV cache dtype; auto: bfloat16, float32 if the model is fp32-only")
    p.add_argument("--device", default=d.device, help="auto (cuda if available, else cpu) | cpu | cuda | cuda:N")
    p.add_argument("--attention-backend", default=d.attention_backend, choices=("auto", "torch", "triton"),
                   help="attention implementation; auto: triton on GPU, torch on CPU")
    p.add_argument("--page-size", type=int, default=d.page_size,
                   help="tokens per KV page, a power of two (the unit of allocation, prefix caching and transfer)")
    p.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens, help="KV pool size in tokens (default: what --kv-cache-gb holds)")
    p.add_argument("--kv-cache-gb", type=float, default=d.kv_cache_gb, help="KV pool size when --max-total-tokens is unset")
    p.add_argument("--context-length", type=int, default=d.context_length,
                   help="longest prompt + output in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests,
                   help="request slots: the largest decode batch")
    p.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
                   help="most new prompt tokens per prefill step (longer prompts are prefilled in chunks)")
    p.add_argument("--disable-prefix-cache", action="store_true",
                   help="do not reuse the KV of prompt prefixes seen before (radix cache)")
    p.add_argument("--num-threads", type=int, default=d.num_threads,
                   help="torch CPU threads (default: torch's own choice; `tandem up` splits the cores between workers)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return dataclasses.replace(
        EngineConfig(),
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
        kv_cache_gb=args.kv_cache_gb,
        context_length=args.context_length,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        enable_prefix_cache=not args.disable_prefix_cache,
        num_threads=args.num_threads,
    )
