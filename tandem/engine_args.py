"""Command-line flags for EngineConfig, shared by every subcommand that runs a model."""

from __future__ import annotations

import argparse
import dataclasses

from engine.config import DTYPES, PREFILL_SCHEDULE_POLICIES, SPECULATIVE_ALGORITHMS, EngineConfig
from services.common.arg_groups import ENGINE, MODEL, SCHEDULER, SPECULATIVE, arg_group


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    model = arg_group(p, MODEL)
    model.add_argument("--model", default=d.model, help="alias (smollm2-135m) or a local Hugging Face folder")
    model.add_argument("--dtype", default=d.dtype, choices=DTYPES,
                       help="weights, activations and KV cache dtype; auto: bfloat16, float32 if the model is "
                            "fp32-only")
    model.add_argument("--device", default=d.device, help="auto (cuda if available, else cpu) | cpu | cuda | cuda:N")
    model.add_argument("--context-length", type=int, default=d.context_length,
                       help="longest prompt + output in tokens (default: the model's max_position_embeddings)")
    engine = arg_group(p, ENGINE)
    engine.add_argument("--attention-backend", default=d.attention_backend, choices=("auto", "torch", "triton"),
                        help="attention implementation; auto: triton on GPU, torch on CPU")
    engine.add_argument("--page-size", type=int, default=d.page_size,
                        help="tokens per KV page, a power of two (the unit of allocation, prefix caching and "
                             "transfer)")
    engine.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens,
                        help="KV pool size in tokens (default: what --kv-cache-gb holds)")
    engine.add_argument("--kv-cache-gb", type=float, default=d.kv_cache_gb,
                        help="KV pool size when --max-total-tokens is unset")
    engine.add_argument("--disable-prefix-cache", action="store_true",
                        help="do not reuse the KV of prompt prefixes seen before (default: reused, radix cache)")
    sched = arg_group(p, SCHEDULER)
    sched.add_argument("--max-running-requests", type=int, default=d.max_running_requests,
                       help="request slots: the largest decode batch")
    sched.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
                       help="most tokens per step: prefill chunks plus, in a mixed step, one per running request "
                            "(longer prompts are prefilled in chunks)")
    _on_off(sched, "mixed-chunk", d.enable_mixed_chunk,
            "run prefill chunks in the same step as the running requests' decode tokens (SGLang's flag, off "
            "there)", "prefill steps and decode steps alternate; a prefill stalls every running request")
    sched.add_argument("--mixed-chunk-itl-factor", type=float, default=d.mixed_chunk_itl_factor,
                       help="bound a mixed step's prefill chunk so that the step takes at most this many times a "
                            "decode step, from measured step times (0: only --chunked-prefill-size bounds it)")
    sched.add_argument("--mixed-chunk-ttft-target", type=float, default=d.mixed_chunk_ttft_target_s,
                       help="seconds: a mixed step's chunk grows beyond the ITL bound just enough for every queued "
                            "prompt to get its first token within this long of its arrival; a prompt that no "
                            "longer can is finished in the next step (0: never)")
    _on_off(sched, "overlap-schedule", d.enable_overlap_schedule,
            "plan and prepare step N+1 while step N's forward pass runs (default: on for CUDA, off for CPU, "
            "where both would share the same cores)",
            "run scheduling, input building and result processing between forward passes (SGLang's flag)")
    sched.add_argument("--prefill-schedule-policy", choices=PREFILL_SCHEDULE_POLICIES,
                       default=d.prefill_schedule_policy,
                       help="who gets a step's prefill token budget first: the prompts with the fewest tokens "
                            "left to compute (shortest-first) or one prompt's every chunk before the next one's "
                            "(fcfs)")
    sched.add_argument("--prefill-max-wait", type=float, default=d.prefill_max_wait_s,
                       help="with shortest-first: a prompt that arrived this many seconds ago goes ahead of "
                            "younger ones, so long prompts are not starved")
    add_queue_arguments(p, d.max_queued_requests)
    sched.add_argument("--priority-preemption-threshold", type=int, default=d.priority_preemption_threshold,
                       help="with --enable-priority-scheduling: a waiting request preempts (retracts, to be "
                            "recomputed later) a running one whose priority is lower by more than this")
    engine.add_argument("--num-threads", type=int, default=d.num_threads,
                        help="torch CPU threads (default: torch's own choice; `tandem up` splits the cores "
                             "between workers)")
    _on_off(engine, "graph", d.enable_graph,
            "run decode steps from graphs captured at start-up for fixed batch sizes (CUDA graphs on GPU, "
            "torch.compile/inductor on CPU; compiled graphs are cached under ~/.cache/tandem/inductor/<ISA level>). Default: "
            "on for CUDA, off on CPU (within 7%% of eager on the project's 2-core CPU, not worth the compile; "
            "docs/benchmarks.md)",
            "always run the model eagerly (SGLang's --disable-cuda-graph)", off_aliases=("--disable-cuda-graph",))
    _on_off(engine, "weight-prepack", d.enable_weight_prepack,
            "bf16 linear layers on CPU multiply by weights reordered once at load into oneDNN's packed layout "
            "(same results as unpacked; 1.7x faster decode projections on the project's 2-core CPU). Default: on "
            "where oneDNN supports bf16 on this CPU and decode graphs are off",
            "multiply by the plain weights (oneDNN reorders them on every call)")
    _on_off(engine, "cpu-kernels", d.enable_cpu_kernels,
            "run decode attention (straight from the KV pages), RMSNorm and RoPE on CPU through Tandem's fused "
            "C++ kernels (kernels/cpu, compiled for this CPU on first use and cached under ~/.cache/tandem). "
            "Default: on CPU with decode graphs off, wherever they build",
            "run the torch code for attention, norms and RoPE")
    engine.add_argument("--graph-max-bs", type=_positive_int, default=d.graph_max_bs, metavar="N",
                        help="largest decode batch run from a graph (bigger ones run eagerly); default: "
                             "--max-running-requests, at most 256 on CUDA / 32 on CPU")
    engine.add_argument("--graph-bs", type=_batch_sizes, default=None, metavar="LIST",
                        help="the batch sizes to capture, comma-separated (a batch runs the smallest one that "
                             "holds it, padded); default: 1,2,4,8,12,16,24,32,40,... on CUDA, 1,2,4,8,16,24,32 "
                             "on CPU, up to --graph-max-bs")
    add_speculative_arguments(p, d)


def add_speculative_arguments(p: argparse.ArgumentParser, d: EngineConfig) -> None:
    """Speculative decoding (engine/spec/), named as SGLang names them."""
    g = arg_group(p, SPECULATIVE)
    g.add_argument("--speculative-algorithm", default=d.speculative_algorithm, choices=SPECULATIVE_ALGORITHMS,
                   help="speculative decoding on decode rows: ngram (drafts looked up in the request's own prompt "
                        "and output) or draft (a small model of the same tokenizer, --speculative-draft-model); "
                        "unset: no speculation")
    g.add_argument("--speculative-num-draft-tokens", type=int, default=d.speculative_num_draft_tokens,
                   help="draft tokens per request per step, all verified in one forward of the target model")
    g.add_argument("--speculative-ngram-min", type=int, default=d.speculative_ngram_min,
                   help="ngram: shortest suffix n-gram of the request's tokens looked up earlier in them")
    g.add_argument("--speculative-ngram-max", type=int, default=d.speculative_ngram_max,
                   help="ngram: longest suffix n-gram looked up (tried first)")
    g.add_argument("--speculative-draft-model", default=d.speculative_draft_model,
                   help="draft: local Hugging Face folder (or alias) of the draft model; it must share the target's tokenizer")
    g.add_argument("--disable-speculative-adaptive", dest="speculative_adaptive", action="store_false",
                   default=d.speculative_adaptive,
                   help="keep speculating even when measured acceptance makes it slower than plain decode "
                        "(by default a batch stops speculating then, and probes it again now and then)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _batch_sizes(text: str) -> str:
    """`1,2,4`: kept as text (forwarded as is to workers); `engine_config_from_args` makes the tuple."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes >= 1, got {text!r}")
    return ",".join(map(str, sorted(set(sizes))))


def _on_off(p: argparse._ActionsContainer, name: str, default: bool | None, on_help: str, off_help: str,
            off_aliases: tuple[str, ...] = ()) -> None:
    """`--enable-NAME` / `--disable-NAME` (and `off_aliases`), one destination (`enable_NAME`); both
    carry the default so that `engine_argv` sees it (argparse would report store_false's implicit True).
    The default is said once, on `--enable-NAME`: on or off, or (None: decided at start) in `on_help`."""
    dest = "enable_" + name.replace("-", "_")
    if default is not None:
        on_help += f" (default: {'on' if default else 'off'})"
    group = p.add_mutually_exclusive_group()
    group.add_argument(f"--enable-{name}", dest=dest, action="store_true", default=default, help=on_help)
    group.add_argument(f"--disable-{name}", *off_aliases, dest=dest, action="store_false", default=default,
                       help=off_help)


def add_queue_arguments(p: argparse.ArgumentParser, max_queued_default: int) -> None:
    """Queue flags that workers and the router share (`tandem up` passes them to both)."""
    g = arg_group(p, SCHEDULER)
    g.add_argument("--max-queued-requests", type=int, default=max_queued_default,
                   help="requests waiting to be served (workers: waiting for compute or, on decode, for KV "
                        "pages; router: for an in-flight slot, see --max-inflight); when full, the one that "
                        "would be served last (the newcomer unless it outranks someone) gets "
                        "RESOURCE_EXHAUSTED / HTTP 429 at once")
    g.add_argument("--enable-priority-scheduling", action="store_true",
                   help="serve queued requests by their `priority`, then arrival (default: arrival only)")
    g.add_argument("--low-priority-values-first", action="store_true",
                   help="a lower `priority` value is more urgent (default: a higher one), as SGLang's "
                        "--schedule-low-priority-values-first")


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of `args` as a command line for another process (`tandem up` -> workers):
    every flag `add_engine_arguments` defines, so a new one is forwarded without a second list.
    Valued flags are always passed; switches only when they change their default."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(parser)
    out: list[str] = []
    for action in parser._actions:
        value = getattr(args, action.dest)
        flag = action.option_strings[0]
        if action.nargs == 0:                       # store_true / store_false switches
            if value == action.const and value != parser.get_default(action.dest):
                out.append(flag)
        elif value is not None:
            out += [flag, str(value)]
    return out


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
        enable_prefix_cache=not args.disable_prefix_cache,
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
    )
