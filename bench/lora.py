"""What serving LoRA adapters costs the engine: TPOT and throughput of a batch of B requests on the
base model alone, on one adapter, and on 8 adapters mixed (each request a different one of them),
rank 16 on all seven projections (issue [23] target: mixed 8 ≤ 1.3× the base model's TPOT at batch 8
and 32).

    python -m tandem.bench.lora --out bench/results/lora.json       # ~3 min on 2 cores

One engine (SmolLM2 by default, the worker's default dtype), random adapters made with PEFT
(random A and B) in a scratch folder, random prompt token ids (nothing cached: adapter requests skip
the prefix cache anyway), greedy, ignore_eos. Rows alternate base / one / mixed per batch size, so a
drift of the machine shows in all of them.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

from tandem.bench.flags import add_load_flags, add_out_flag
from tandem.bench.results import write_result
from tandem.bench.structured import timed_run
from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.models.source import resolve_model
from tandem.engine.sampling_params import SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapters(model_dir: Path, out: Path, n: int, rank: int) -> dict[str, Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = {}
    for i in range(n):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS),
                                                init_lora_weights=False))
        paths[f"lora{i}"] = out / f"lora{i}"
        peft.save_pretrained(paths[f"lora{i}"])
    return paths


def run(engine: LLMEngine, prompts: list[list[int]], loras: list[str | None], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params, lora=name) for p, name in zip(prompts, loras, strict=True)]
    out = timed_run(engine, rids)
    return {k: out[k] for k in ("tpot_ms", "throughput_tok_s", "wall_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_load_flags(ap, seed=0, input_len=128, max_tokens=64)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    add_out_flag(ap)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-lora-") as tmp:
        paths = make_adapters(resolve_model(args.model), Path(tmp), args.adapters, args.rank)
        engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, enable_lora=True,
                                        lora_modules=tuple((n, str(p)) for n, p in paths.items()),
                                        lora_eager_load=True,   # timed steps never read an adapter from disk
                                        max_loras=args.adapters, max_lora_rank=args.rank,
                                        max_running_requests=max(64, *map(int, args.batches.split(",")))))
        names = list(paths)
        path = engine.loras.path      # how the adapters are applied (engine/lora/batch.py choose)
        print(f"adapters applied by: {path}", flush=True)
        rows = []
        vocab = engine.model_config.vocab_size
        for b in map(int, args.batches.split(",")):
            for case, loras in (("base", [None] * b), ("one adapter", [names[0]] * b),
                                (f"{len(names)} adapters mixed", [names[i % len(names)] for i in range(b)])):
                prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(b)]
                row = {"batch": b, "case": case, **run(engine, prompts, loras, args.max_tokens)}
                rows.append(row)
                print(f"batch {b:>3} {case:>18}: TPOT {row['tpot_ms']:.1f} ms, {row['throughput_tok_s']:.0f} tok/s",
                      flush=True)
        engine.close()
    base = {r["batch"]: r["tpot_ms"] for r in rows if r["case"] == "base"}
    for r in rows:
        r["tpot_vs_base"] = round(r["tpot_ms"] / base[r["batch"]], 3)
    if args.out:
        write_result(args.out, {"bench": "lora", "model": args.model, "dtype": args.dtype, "rank": args.rank,
                                "adapters": args.adapters, "lora_path": path, "input_len": args.input_len,
                                "max_tokens": args.max_tokens,
                                "rows": rows}, tool="tandem.bench.lora")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
