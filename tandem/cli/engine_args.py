"""The engine's command-line flags (EngineConfig), declared once: every subcommand that runs a model
takes them, and `tandem up` forwards the ones the user set to its workers."""

from __future__ import annotations

import argparse
import dataclasses
import json

from tandem.engine.config import (
    DTYPES,
    KV_LAYOUTS,
    PREFILL_SCHEDULE_POLICIES,
    SPECULATIVE_ALGORITHMS,
    EngineConfig,
)
from tandem.services.common.arg_groups import ENGINE, LORA, MODEL, SCHEDULER, SPECULATIVE
from tandem.services.common.flags import Flag, Owner, add_flags
from tandem.services.common.shared_flags import LORA_RUNTIME_UPDATING, MODEL_FLAG, QUEUE_FLAGS

_E = Owner.ENGINE


def _on_off(name: str, group: str, on_help: str, off_help: str, off_aliases: tuple[str, ...] = ()) -> Flag:
    """`--enable-NAME` / `--disable-NAME` (and `off_aliases`), one destination: EngineConfig.enable_NAME.
    The default is said once, on `--enable-NAME`: on or off, or (None: decided at start) in `on_help`."""
    field = "enable_" + name.replace("-", "_")
    return Flag((f"--enable-{name}",), _E, group, on_help, field=field, action="on_off",
                off=(f"--disable-{name}", *off_aliases), off_help=off_help)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _batch_sizes(text: str) -> str:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes >= 1, got {text!r}")
    return ",".join(map(str, sorted(set(sizes))))


DTYPE = Flag(("--dtype",), _E, MODEL,
             "weights, activations and KV cache dtype; auto: what this device computes fast -- bfloat16 on a "
             "CPU with native bf16 (AVX512-BF16, AMX, Arm BF16) or a GPU that has it, float32 on other CPUs "
             "(AVX2-only: bf16 is 3-6x slower there), float16 on older GPUs (the start-up log says why)",
             field="dtype", choices=DTYPES)
ENGINE_FLAGS = (
    MODEL_FLAG, DTYPE,
    Flag(("--device",), _E, MODEL, "auto (cuda if available, else cpu) | cpu | cuda | cuda:N", field="device"),
    Flag(("--context-length",), _E, MODEL,
         "longest prompt + output in tokens (default: the model's max_position_embeddings)", field="context_length",
         type=int),
    Flag(("--attention-backend",), _E, ENGINE, "attention implementation; auto: triton on GPU, torch on CPU",
         field="attention_backend", choices=("auto", "torch", "triton")),
    Flag(("--page-size",), _E, ENGINE,
         "tokens per KV page, a power of two (the unit of allocation, prefix caching and transfer)",
         field="page_size", type=int),
    Flag(("--kv-layout",), _E, ENGINE,
         "KV pool layout: page_first keeps a page of every layer in one block (one piece per page to transfer "
         "or tier: transfers 1.2-3.8x faster), layer_first one block per layer and K|V (on CPU, decode 3-23%% "
         "faster); auto: layer_first on CPU, page_first on GPUs. Prefill and decode "
         "workers must use the same",
         field="kv_layout", choices=("auto", *KV_LAYOUTS)),
    Flag(("--max-total-tokens",), _E, ENGINE, "KV pool size in tokens (default: what --kv-cache-gb holds)",
         field="max_total_tokens", type=int),
    Flag(("--kv-cache-gb",), _E, ENGINE, "KV pool size when --max-total-tokens is unset", field="kv_cache_gb",
         type=float),
    Flag(("--disable-prefix-cache",), _E, ENGINE,
         "do not reuse the KV of prompt prefixes seen before (default: reused, radix cache)",
         field="enable_prefix_cache", action="store_false", dest="enable_prefix_cache"),
    Flag(("--kv-host-cache-gb",), _E, ENGINE,
         "GiB of host memory (L2) that keeps the KV pages the prefix cache evicts, loaded back instead of "
         "recomputed when a prompt needs them again (0: off)",
         field="kv_host_cache_gb", type=float),
    Flag(("--kv-disk-cache-dir",), _E, ENGINE,
         "directory (L3) that keeps evicted KV pages on local disk, below --kv-host-cache-gb; survives restarts "
         "and may be shared by the workers of one host (unset: off)",
         field="kv_disk_cache_dir", metavar="DIR"),
    Flag(("--kv-disk-cache-gb",), _E, ENGINE, "GiB --kv-disk-cache-dir may hold (least recently used go first)",
         field="kv_disk_cache_gb", type=float),
    Flag(("--kv-write-policy",), _E, ENGINE,
         "when the KV tiers get a page: write_through (as soon as the prefix cache takes it: a worker killed "
         "with -9 restarts warm from --kv-disk-cache-dir) or write_back (only when the prefix cache evicts it)",
         field="kv_write_policy", choices=("write_through", "write_back")),
    _on_off("any-whitespace", ENGINE,
            "structured output: JSON in the model's own formatting, bounded (one space, or one newline and some "
            "indentation, between two JSON tokens; never blank lines); off by measurement (docs/benchmarks.md)",
            "structured output: JSON with no whitespace between its tokens but json.dumps' ', ' and ': ' (vLLM's "
            "disable_any_whitespace)"),
    Flag(("--max-running-requests",), _E, SCHEDULER, "request slots: the largest decode batch",
         field="max_running_requests", type=int),
    Flag(("--chunked-prefill-size",), _E, SCHEDULER,
         "most tokens per step: prefill chunks plus, in a mixed step, one per running request (longer prompts are "
         "prefilled in chunks)", field="chunked_prefill_size", type=int),
    _on_off("mixed-chunk", SCHEDULER,
            "run prefill chunks in the same step as the running requests' decode tokens (SGLang's flag, off there)",
            "prefill steps and decode steps alternate; a prefill stalls every running request"),
    Flag(("--mixed-chunk-itl-factor",), _E, SCHEDULER,
         "bound a mixed step's prefill chunk so that the step takes at most this many times a decode step, from "
         "measured step times (0: only --chunked-prefill-size bounds it)", field="mixed_chunk_itl_factor",
         type=float),
    Flag(("--mixed-chunk-ttft-target",), _E, SCHEDULER,
         "seconds: a mixed step's chunk grows beyond the ITL bound just enough for every queued prompt to get its "
         "first token within this long of its arrival; a prompt that no longer can is finished in the next step "
         "(0: never)", field="mixed_chunk_ttft_target_s", type=float),
    _on_off("overlap-schedule", SCHEDULER,
            "plan and prepare step N+1 while step N's forward pass runs (default: on for CUDA, off for CPU, where "
            "both would share the same cores)",
            "run scheduling, input building and result processing between forward passes (SGLang's flag)"),
    Flag(("--prefill-schedule-policy",), _E, SCHEDULER,
         "who gets a step's prefill token budget first: the prompts with the fewest tokens left to compute "
         "(shortest-first) or one prompt's every chunk before the next one's (fcfs)",
         field="prefill_schedule_policy", choices=PREFILL_SCHEDULE_POLICIES),
    Flag(("--prefill-max-wait",), _E, SCHEDULER,
         "with shortest-first: a prompt that arrived this many seconds ago goes ahead of younger ones, so long "
         "prompts are not starved", field="prefill_max_wait_s", type=float),
    *QUEUE_FLAGS,
    Flag(("--priority-preemption-threshold",), _E, SCHEDULER,
         "with --enable-priority-scheduling: a waiting request preempts (retracts, to be recomputed later) a "
         "running one whose priority is lower by more than this", field="priority_preemption_threshold", type=int),
    Flag(("--num-threads",), _E, ENGINE,
         "torch CPU threads (default: torch's own choice; `tandem up` splits the cores between workers)",
         field="num_threads", type=int),
    _on_off("graph", ENGINE,
            "run decode steps from graphs captured at start-up for fixed batch sizes (CUDA graphs on GPU, "
            "torch.compile/inductor on CPU; compiled graphs are cached under ~/.cache/tandem/inductor/<ISA level>). "
            "Default: on for CUDA, off on CPU (within 7%% of eager on the project's 2-core CPU, not worth the "
            "compile; docs/benchmarks.md)",
            "always run the model eagerly (SGLang's --disable-cuda-graph)", off_aliases=("--disable-cuda-graph",)),
    _on_off("weight-prepack", ENGINE,
            "bf16 linear layers on CPU multiply by weights reordered once at load into oneDNN's packed layout (same "
            "results as unpacked; 1.7x faster decode projections on the project's 2-core CPU); fp32 ones run Tandem's "
            "linear kernel on panel-packed weights (~2x faster decode steps). Default: on where oneDNN supports bf16 "
            "(bf16) or the CPU kernels are on (fp32), and decode graphs are off",
            "multiply by the plain weights (F.linear)"),
    _on_off("cpu-kernels", ENGINE,
            "run decode attention (straight from the KV pages), RMSNorm and RoPE on CPU through Tandem's fused C++ "
            "kernels (kernels/cpu, compiled for this CPU on first use and cached under ~/.cache/tandem). Default: "
            "on CPU with decode graphs off, wherever they build",
            "run the torch code for attention, norms and RoPE"),
    Flag(("--graph-max-bs",), _E, ENGINE,
         "largest decode batch run from a graph (bigger ones run eagerly); default: --max-running-requests, at most "
         "256 on CUDA / 32 on CPU", field="graph_max_bs", type=_positive_int, metavar="N"),
    # Kept as text (forwarded as is); `engine_config_from_args` makes the tuple.
    Flag(("--graph-bs",), _E, ENGINE,
         "the batch sizes to capture, comma-separated (a batch runs the smallest one that holds it, padded); "
         "default: 1,2,4,8,12,16,24,32,40,... on CUDA, 1,2,4,8,16,24,32 on CPU, up to --graph-max-bs",
         type=_batch_sizes, metavar="LIST"),
    # Speculative decoding (engine/spec/), named as SGLang names them.
    Flag(("--speculative-algorithm",), _E, SPECULATIVE,
         "speculative decoding on decode rows: ngram (drafts looked up in the request's own prompt and output) or "
         "draft (a small model of the same tokenizer, --speculative-draft-model); unset: no speculation",
         field="speculative_algorithm", choices=SPECULATIVE_ALGORITHMS),
    Flag(("--speculative-num-draft-tokens",), _E, SPECULATIVE,
         "draft tokens per request per step, all verified in one forward of the target model",
         field="speculative_num_draft_tokens", type=int),
    Flag(("--speculative-ngram-min",), _E, SPECULATIVE,
         "ngram: shortest suffix n-gram of the request's tokens looked up earlier in them",
         field="speculative_ngram_min", type=int),
    Flag(("--speculative-ngram-max",), _E, SPECULATIVE, "ngram: longest suffix n-gram looked up (tried first)",
         field="speculative_ngram_max", type=int),
    Flag(("--speculative-draft-model",), _E, SPECULATIVE,
         "draft: local Hugging Face folder (or alias) of the draft model; it must share the target's tokenizer",
         field="speculative_draft_model"),
    _on_off("lora", LORA,
            "serve LoRA adapters (PEFT folders) beside the base model: a request names one as its `model`; one "
            "step mixes requests of different adapters and the base model (docs/lora.md)",
            "serve the base model only"),
    Flag(("--lora-modules",), _E, LORA,
         "an adapter to serve, NAME=PATH (PATH: a PEFT folder with adapter_config.json and "
         "adapter_model.safetensors); repeat for more; needs --enable-lora", action="append", metavar="NAME=PATH"),
    Flag(("--max-loras",), _E, LORA, "most distinct adapters in one step", field="max_loras", type=int),
    Flag(("--max-lora-rank",), _E, LORA, "the largest adapter rank accepted (a higher one is refused at load)",
         field="max_lora_rank", type=int),
    Flag(("--max-cpu-loras",), _E, LORA, "adapters kept loaded (default: --max-loras); loading one more drops the "
         "least recently used one no request in flight uses", field="max_cpu_loras", type=int),
    Flag(("--lora-eager-load",), _E, LORA, "load every --lora-modules adapter at start (default: when a request "
         "first needs it on this worker)", field="lora_eager_load", action="store_true"),
    LORA_RUNTIME_UPDATING,
    Flag(("--disable-speculative-adaptive",), _E, SPECULATIVE,
         "keep speculating even when measured acceptance makes it slower than plain decode (by default a batch "
         "stops speculating then, and probes it again now and then)", field="speculative_adaptive",
         action="store_false", dest="speculative_adaptive"),
)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, ENGINE_FLAGS, {Owner.ENGINE: EngineConfig()})


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
        enable_mixed_chunk=args.enable_mixed_chunk,
        mixed_chunk_itl_factor=args.mixed_chunk_itl_factor,
        mixed_chunk_ttft_target_s=args.mixed_chunk_ttft_target,
        enable_prefix_cache=args.enable_prefix_cache,
        enable_any_whitespace=args.enable_any_whitespace,
        kv_host_cache_gb=args.kv_host_cache_gb,
        kv_disk_cache_dir=args.kv_disk_cache_dir,
        kv_disk_cache_gb=args.kv_disk_cache_gb,
        kv_write_policy=args.kv_write_policy,
        kv_layout=args.kv_layout,
        enable_overlap_schedule=args.enable_overlap_schedule,
        prefill_schedule_policy=args.prefill_schedule_policy,
        prefill_max_wait_s=args.prefill_max_wait,
        max_queued_requests=args.max_queued_requests,
        enable_priority_scheduling=args.enable_priority_scheduling,
        low_priority_values_first=args.low_priority_values_first,
        priority_preemption_threshold=args.priority_preemption_threshold,
        num_threads=args.num_threads,
        enable_graph=args.enable_graph,
        enable_weight_prepack=args.enable_weight_prepack,
        enable_cpu_kernels=args.enable_cpu_kernels,
        graph_max_bs=args.graph_max_bs,
        graph_bs=tuple(int(b) for b in args.graph_bs.split(",")) if args.graph_bs else None,
        speculative_algorithm=args.speculative_algorithm,
        speculative_num_draft_tokens=args.speculative_num_draft_tokens,
        speculative_ngram_min=args.speculative_ngram_min,
        speculative_ngram_max=args.speculative_ngram_max,
        speculative_draft_model=args.speculative_draft_model,
        speculative_adaptive=args.speculative_adaptive,
        enable_lora=args.enable_lora,
        lora_modules=tuple(_lora_module(m) for m in args.lora_modules or ()),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        lora_eager_load=args.lora_eager_load,
        enable_lora_runtime_updating=args.enable_lora_runtime_updating,
    )


def _lora_module(text: str) -> tuple[str, str]:
    """`--lora-modules NAME=PATH` (or vLLM's JSON form {"name": ..., "path": ...}) -> (name, path)."""
    if text.lstrip().startswith("{"):
        try:
            d = json.loads(text)
            return str(d["name"]), str(d["path"])
        except (ValueError, KeyError, TypeError):
            raise SystemExit(f"--lora-modules {text!r}: JSON needs \"name\" and \"path\"") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise SystemExit(f"--lora-modules {text!r}: expected NAME=PATH")
    return name, path
