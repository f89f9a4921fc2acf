"""`tandem bench serve|sweep`: load-test an endpoint, or compare deployments this tool starts itself."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys

from tandem.bench.flags import add_load_flags, add_out_flag, add_progress_flags, add_stack_flags, floats
from tandem.cli.engine_args import DTYPE
from tandem.engine.config import EngineConfig
from tandem.services.common.flags import Owner
from tandem.services.common.shared_flags import MODEL_FLAG


def _priority_mix(text: str) -> tuple[tuple[int, float], ...]:
    from tandem.bench.serve.datasets import parse_priority_mix

    try:
        return parse_priority_mix(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _load_profile(text: str):
    from tandem.bench.serve.load_profile import parse_load_profile

    try:
        return parse_load_profile(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", default="random", choices=["random", "shared-prefix", "sharegpt", "multi-turn"],
                   help="random token prompts, groups of prompts sharing a prefix, ShareGPT conversations, or "
                        "multi-turn conversations (closed loop: each turn is sent after the previous answer, "
                        "whose text it includes)")
    g.add_argument("--dataset-path", default=None, help="sharegpt: a ShareGPT-format JSON file")
    add_load_flags(g, num_prompts=None, input_len=256, output_len=None, range_ratio=0.0, helps={
        "num_prompts": "requests per request rate (multi-turn: must equal conversations x turns if given)",
        "input_len": "prompt tokens (shared-prefix: tokens after the shared prefix; multi-turn: unused)",
        "output_len": "output tokens (default 64; sharegpt: the reference reply's length; multi-turn: each answer's)"})
    g.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens of each group's prefix")
    g.add_argument("--num-prefix-groups", type=int, default=4, help="shared-prefix: number of distinct prefixes")
    g.add_argument("--multi-turn-conversations", type=int, default=32,
                   help="multi-turn: conversations per request rate; the rate is of conversation starts/s")
    g.add_argument("--multi-turn-turns", type=int, default=6, help="multi-turn: turns (requests) per conversation")
    g.add_argument("--multi-turn-user-len", type=int, default=200,
                   help="multi-turn: user tokens each turn adds after the previous answer (--range-ratio applies)")
    g.add_argument("--multi-turn-think-time", type=float, default=1.0,
                   help="multi-turn: mean seconds between an answer and the next turn (exponential, seeded; 0: none)")
    # By hand, not add_load_flags(seed=...): tests/tandem/test_flags.py knows the workload's --seed as
    # this module's (--seed is also `tandem generate`'s sampling seed).
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the prompts, their lengths, the think times and the arrival times")
    g.add_argument("--priority-mix", type=_priority_mix, default=(),
                   help="send each request a `priority` drawn from these classes in these proportions, "
                        "PRIORITY:WEIGHT,... (e.g. 10:1,0:3: a quarter at 10); metrics are also "
                        "reported per class (the server needs --enable-priority-scheduling to act on them)")
    g = p.add_argument_group("load")
    add_load_flags(g, burstiness=1.0, max_concurrency=None)
    g.add_argument("--percentiles", type=floats, default=(50.0, 90.0, 99.0), help="e.g. 50,90,99")
    add_progress_flags(g, save_requests=True)


def _dataset(args: argparse.Namespace, default_prompts: int):
    from tandem.bench.serve.datasets import DatasetConfig

    output_len = args.output_len
    if output_len is None and args.dataset_name != "sharegpt":
        output_len = 64
    num_prompts = args.num_prompts or default_prompts
    if args.dataset_name == "multi-turn":
        turns = args.multi_turn_conversations * args.multi_turn_turns
        if args.num_prompts is not None and args.num_prompts != turns:
            raise ValueError(f"multi-turn sends --multi-turn-conversations x --multi-turn-turns = {turns} requests "
                             f"per rate; --num-prompts {args.num_prompts} disagrees (leave it out)")
        num_prompts = turns
    return DatasetConfig(
        name=args.dataset_name, num_prompts=num_prompts, input_len=args.input_len,
        output_len=output_len, range_ratio=args.range_ratio, prefix_len=args.prefix_len,
        num_prefix_groups=args.num_prefix_groups, path=args.dataset_path, seed=args.seed,
        priority_mix=args.priority_mix, multi_turn_conversations=args.multi_turn_conversations,
        multi_turn_turns=args.multi_turn_turns, multi_turn_user_len=args.multi_turn_user_len,
        multi_turn_think_time=args.multi_turn_think_time)


def _add_model_argument(p: argparse.ArgumentParser) -> None:
    """The engine's --model: the one serve asks for (and counts tokens with), the one sweep deploys."""
    MODEL_FLAG.add_to(p, MODEL_FLAG.default_in({Owner.ENGINE: EngineConfig()}))


def _add_run_arguments(p: argparse.ArgumentParser, num_warmups: int, slo: str, out: str | None) -> None:
    """What serve and sweep both take, declared once (their defaults differ)."""
    add_load_flags(p, num_warmups=num_warmups, slo=slo, helps={
        "num_warmups": "requests sent one by one before measuring (sweep: before each deployment's runs)"})
    add_out_flag(p, out, help="results JSON (plots are written beside it)")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.bench.serve.backends import BACKENDS, FORCE_OUTPUT_LEN

    p.add_argument("--backend", default="openai-http", choices=sorted(BACKENDS),
                   help="an OpenAI-compatible HTTP server (Tandem's gateway or another), or Tandem's gRPC router")
    p.add_argument("--base-url", default=None,
                   help="openai-http: http://HOST:PORT (default http://127.0.0.1:8000); "
                        "tandem-grpc: HOST:PORT (default 127.0.0.1:50051)")
    p.add_argument("--endpoint", default="/v1/completions", help="openai-http: /v1/completions or /v1/chat/completions")
    _add_model_argument(p)
    p.add_argument("--served-model-name", default=None,
                   help="name sent in requests (default: --model for openai-http, the router's default for gRPC)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json, a model folder or an alias (default: --model)")
    add_load_flags(p, request_rate=(math.inf,))   # a tuple: comma-separated rates, one run each
    p.add_argument("--load-profile", type=_load_profile, default=None, metavar="SPEC",
                   help="one run made of phases instead of --request-rate/--num-prompts: DURATION@RATE:IN/OUT,..., "
                        "e.g. 90s@0.5:128/256,120s@3:256/64,90s@1:1024/32 (a phase may be named, burst=120s@3:256/64), "
                        "or a JSON file of phases; Poisson arrivals follow the phase (--burstiness applies), "
                        "metrics are reported per phase and as a time series")
    p.add_argument("--load-profile-window", type=float, default=5.0, metavar="SECONDS",
                   help="--load-profile: the time series' window (s)")
    _add_run_arguments(p, num_warmups=1, slo="", out=None)
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    p.add_argument("--force-output-len", default="ignore-eos", choices=FORCE_OUTPUT_LEN,
                   help="how to make the server produce exactly --output-len tokens")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every HTTP request body")
    p.add_argument("--trace-file", default=None,
                   help="the spans file of a stack run with --otlp-traces-endpoint file://PATH: print and store "
                        "TTFT broken into phases (p50/p99), warm-ups included (bench/trace_breakdown.py)")
    p.add_argument("--api-key", default=None,
                   help="bearer token: HTTP `Authorization` header, or tandem-grpc metadata "
                        "(default: $TANDEM_API_KEY, else $OPENAI_API_KEY)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--label", default="", help="name of this endpoint in output and plots")
    p.add_argument("--no-plot", action="store_true", help="write the JSON only, no PNG plots")
    _add_workload_arguments(p)


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    _add_model_argument(p)
    p.add_argument("--deployments", default="colocated,1p1d,transformers",
                   help="comma-separated: colocated, NpMd (e.g. 1p1d), transformers, vllm (`make vllm-venv` first)")
    p.add_argument("--request-rates", type=floats, default=(0.5, 1.0, 2.0, 4.0),
                   help="requests/s of each run, comma-separated (inf = all at once)")
    _add_run_arguments(p, num_warmups=2, slo="ttft=2s,tpot=150ms", out="bench/results/sweep.json")
    p.add_argument("--tandem-backend", default="openai-http", choices=["openai-http", "tandem-grpc"],
                   help="how to reach Tandem deployments: its OpenAI HTTP gateway (as the peer) or the router's gRPC API")
    # The engine's --dtype, which sweep gives every deployment (the peers too).
    DTYPE.add_to(p, DTYPE.default_in({Owner.ENGINE: EngineConfig()}))
    add_stack_flags(p, up_args="")
    p.add_argument("--peer-kv-cache-gb", type=float, default=1.0,
                   help="transformers serve's KV cache (its CPU default takes 60%% of RAM and crawls)")
    p.add_argument("--peer-args", default="", help="extra `transformers serve` flags")
    p.add_argument("--vllm-venv", default=None,
                   help="the vllm deployment's venv (default: $TANDEM_VLLM_VENV, else .venv-vllm from `make vllm-venv`)")
    p.add_argument("--vllm-kv-cache-gb", type=int, default=2, help="vLLM's KV space, GiB (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--vllm-max-model-len", type=int, default=2048, help="vLLM's --max-model-len")
    p.add_argument("--vllm-args", default="", help="extra flags of vLLM's OpenAI api_server")
    g = p.add_argument_group("capacity at SLO (bench/serve/capacity.py)")
    g.add_argument("--find-capacity", action="store_true",
                   help="instead of --request-rates: raise each deployment's rate until fewer than --capacity-goal of "
                        "requests meet the SLO, bisect, per seed; report each capacity beside the compute limit")
    g.add_argument("--capacity-goal", type=float, default=0.9, help="share of requests that must meet the SLO")
    g.add_argument("--capacity-start", type=float, default=0.5, help="req/s of the first run")
    g.add_argument("--capacity-max", type=float, default=64.0, help="req/s beyond which the search stops raising")
    g.add_argument("--capacity-steps", type=int, default=3, help="bisection runs after the bracket is found")
    g.add_argument("--capacity-seeds", type=int, default=2, help="searches per deployment, each with fresh prompts")
    g.add_argument("--capacity-duration", type=float, default=60.0,
                   help="seconds of arrivals per run: max(--num-prompts, rate x this) requests (0: --num-prompts)")
    add_stack_flags(p, start_timeout=600.0)
    _add_workload_arguments(p)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", required=True)
    for name, summary, add in (
            ("serve", "load-test an OpenAI HTTP endpoint or Tandem's gRPC API", add_serve_arguments),
            ("sweep", "start deployments here and compare them across request rates", add_sweep_arguments)):
        add(sub.add_parser(name, help=summary, description=summary, formatter_class=p.formatter_class))


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key is not None:
        return args.api_key or None
    return os.environ.get("TANDEM_API_KEY") or os.environ.get("OPENAI_API_KEY") or None


def run_serve(args: argparse.Namespace) -> int:
    from tandem.bench.serve.backends import DEFAULT_URLS, BackendConfig
    from tandem.bench.serve.metrics import SLO
    from tandem.bench.serve.runner import WarmupFailed
    from tandem.bench.serve.serve import ServeConfig, run_serve

    try:
        extra = json.loads(args.extra_body) if args.extra_body else {}
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
        if args.load_profile is not None and (args.num_prompts is not None or args.request_rate != (math.inf,)):
            raise ValueError("--load-profile sets the request rates and counts: leave out --request-rate and "
                             "--num-prompts")
        name = args.served_model_name
        if name is None:
            name = args.model if args.backend == "openai-http" else ""
        cfg = ServeConfig(
            backend=args.backend,
            backend_cfg=BackendConfig(base_url=args.base_url or DEFAULT_URLS[args.backend], model=name,
                                      endpoint=args.endpoint, temperature=args.temperature,
                                      force_output_len=args.force_output_len, extra_body=extra, timeout_s=args.timeout,
                                      api_key=_api_key(args)),
            tokenizer=args.tokenizer or args.model, dataset=_dataset(args, 100), request_rates=args.request_rate,
            burstiness=args.burstiness, max_concurrency=args.max_concurrency, num_warmups=args.num_warmups,
            slo=SLO.parse(args.slo), percentiles=args.percentiles, progress=not args.no_progress,
            label=args.label, out=args.out, plot=not args.no_plot, save_requests=not args.no_save_requests,
            trace_file=args.trace_file, load_profile=args.load_profile, window_s=args.load_profile_window)
        result = run_serve(cfg)
    except (ValueError, OSError, WarmupFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Exit status 1 when every measured request failed (a smoke run can rely on it).
    return 1 if all(r["metrics"]["completed"] == 0 for r in result["runs"]) else 0


def run_sweep(args: argparse.Namespace) -> int:
    from tandem.bench.serve.capacity import CapacityConfig
    from tandem.bench.serve.metrics import SLO
    from tandem.bench.serve.sweep import SweepConfig, run_sweep

    try:
        capacity = None
        if args.find_capacity:
            capacity = CapacityConfig(goal=args.capacity_goal, start_rate=args.capacity_start,
                                      max_rate=args.capacity_max, bisect_steps=args.capacity_steps,
                                      seeds=args.capacity_seeds, duration_s=args.capacity_duration)
            capacity.validate()
        cfg = SweepConfig(
            model=args.model, deployments=tuple(d.strip() for d in args.deployments.split(",") if d.strip()),
            request_rates=args.request_rates, dataset=_dataset(args, 40), burstiness=args.burstiness,
            max_concurrency=args.max_concurrency, num_warmups=args.num_warmups, slo=SLO.parse(args.slo),
            percentiles=args.percentiles, tandem_backend=args.tandem_backend, dtype=args.dtype,
            up_args=tuple(shlex.split(args.up_args)), peer_kv_cache_gb=args.peer_kv_cache_gb,
            peer_args=tuple(shlex.split(args.peer_args)), start_timeout_s=args.start_timeout, out=args.out,
            progress=not args.no_progress, save_requests=not args.no_save_requests,
            vllm_kv_cache_gb=args.vllm_kv_cache_gb, vllm_max_model_len=args.vllm_max_model_len,
            vllm_args=tuple(shlex.split(args.vllm_args)), capacity=capacity,
            **({"vllm_venv": args.vllm_venv} if args.vllm_venv else {}))
        result = run_sweep(cfg)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if result["deployments"] else 1


def run(args: argparse.Namespace) -> int:
    return {"serve": run_serve, "sweep": run_sweep}[args.bench_command](args)
