"""`tandem generate`: offline generation with the co-located engine, streamed to stdout."""

from __future__ import annotations

import argparse
import sys

from tandem.cli.engine_args import add_engine_arguments, engine_config_from_args
from tandem.engine.sampling_params import SamplingDefaults, SamplingParams
from tandem.services.common.arg_groups import GENERATION, arg_group


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    g = arg_group(p, GENERATION)
    g.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate per prompt")
    # Unset: the model's generation_config.json, else OpenAI's (engine/sampling_params.py), as on every API.
    d = SamplingDefaults()
    g.add_argument("--temperature", type=float, default=None,
                   help=f"sampling temperature in [0, 2]; 0: greedy (default: the model's, else {d.temperature:g})")
    g.add_argument("--top-p", type=float, default=None,
                   help=f"nucleus sampling: keep the top tokens up to this mass (default: the model's, else "
                        f"{d.top_p:g})")
    g.add_argument("--top-k", type=int, default=None,
                   help=f"keep the k most likely tokens; -1: all (default: the model's, else {d.top_k})")
    g.add_argument("--min-p", type=float, default=None,
                   help=f"drop tokens below min_p x the top token's probability (default: the model's, else "
                        f"{d.min_p:g})")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help=f"> 1 discourages repeating tokens (default: the model's, else {d.repetition_penalty:g})")
    g.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default: unseeded); see docs/sampling.md for what it guarantees")
    g.add_argument("--stop", action="append", default=[], help="stop string, not included in the output; repeatable")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    """The request's sampling parameters; a flag not given stays unset (None) for the engine to fill
    from the model's generation_config.json (`LLMEngine.make_request`)."""
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
    )


def run(args: argparse.Namespace) -> int:
    # Heavy imports here, not at module import: `tandem --help` stays instant.
    from tandem.engine.engine import LLMEngine
    from tandem.engine.errors import TandemError

    try:
        params = sampling_from_args(args)
        params.validate()
        engine = LLMEngine(engine_config_from_args(args))
        prompts = args.prompt
        if args.chat:
            prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        if len(prompts) == 1:
            for delta in engine.stream(prompts[0], params):
                sys.stdout.write(delta.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
        else:
            for i, res in enumerate(engine.generate(prompts, params)):
                print(f"[{i}] {res.text!r} ({res.finish_reason.value}, {res.usage.completion_tokens} tokens)")
        engine.check_idle()
        engine.close()   # the KV tiers' disk writes finish before the process exits
    except TandemError as e:
        param = getattr(e, "param", None)
        print(f"error: {e}" + (f" (param: {param})" if param else ""), file=sys.stderr)
        return 2
    return 0
