"""Structured output's cost on the engine: TPOT and throughput with a JSON Schema vs free text at
batch 1, 8 and 32 (target: <= 10% TPOT overhead at batch 8), how long sampling waited for the
grammar masks after the forward pass, and grammar compile time cold / cached.

    flock /tmp/tandem-bench.lock python -m tandem.bench.structured --out bench/results/structured.json
    python -m tandem.bench.structured --batches 1 --max-tokens 8            # a smoke run

One engine (SmolLM2 by default), greedy. Free-text rows ignore EOS and run max_tokens; schema rows
end when their object is complete, so TPOT (per request: time between its first and last token over
the tokens between) is what compares, with throughput (output tokens / wall) beside it. Overlap
follows the device's default unless --overlap / --no-overlap.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

from tandem.bench.flags import add_load_flags, add_out_flag, add_stack_flags
from tandem.bench.grammar_libs import SCHEMA
from tandem.bench.results import write_result
from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured import compile as grammar_compile
from tandem.engine.structured_output import StructuredSpec

QUESTIONS = ["Describe a customer called Ada who lives in London and ordered two books.",
             "Make up a customer from Paris with three orders.",
             "Invent a customer record for a retired teacher in Rome.",
             "Create a JSON profile for a student in Berlin who bought a bike."]


def prompts(engine: LLMEngine, n: int) -> list[str]:
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)] + f" (record {i})"
        msgs = [{"role": "user", "content": q + " Answer in JSON."}]
        out.append(engine.tokenizer.apply_chat_template(msgs) if engine.tokenizer.has_chat_template else q)
    return out


def timed_run(engine: LLMEngine, rids: list[str], on_step=None) -> dict:
    """Step the engine until every request ended: output tokens, wall time, throughput and the mean TPOT
    per request (time between its first and last token over the tokens between). `on_step()` runs
    after each step (e.g. to read the runner's timings)."""
    first, last, count = {}, {}, dict.fromkeys(rids, 0)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        if on_step is not None:
            on_step()
        now = time.perf_counter()
        for o in outs:
            if o.token_ids:
                first.setdefault(o.rid, now)
                last[o.rid] = now
                count[o.rid] += len(o.token_ids)
    wall = time.perf_counter() - t0
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in rids if count[r] > 1]
    return {"requests": len(rids), "output_tokens": sum(count.values()), "wall_s": round(wall, 3),
            "throughput_tok_s": round(sum(count.values()) / wall, 2),
            "tpot_ms": round(1e3 * statistics.fmean(tpot), 3) if tpot else None}


def run(engine: LLMEngine, texts: list[str], params: SamplingParams) -> dict:
    rids = [engine.add_request(t, params) for t in texts]
    waits: list[float] = []
    out = timed_run(engine, rids, lambda: waits.append(engine.runner.last_timings.mask_wait_s))
    engine._drain()
    return {**out, "mask_wait_ms_per_step": round(1e3 * sum(waits) / max(1, len(waits)), 4)}


def compile_times() -> dict:
    grammar_compile.clear_cache()
    spec = StructuredSpec.json_schema(SCHEMA)
    t0 = time.perf_counter()
    grammar_compile.compile_grammar(spec)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar_compile.compile_grammar(spec)
    cached = time.perf_counter() - t0
    return {"router_compile_cold_ms": round(1e3 * cold, 3), "router_compile_cached_ms": round(1e3 * cached, 4)}


def worker_compile_times(engine: LLMEngine) -> dict:
    t0 = time.perf_counter()
    backend = engine.grammar_backend()
    setup = time.perf_counter() - t0
    spec = StructuredSpec.json_schema(dict(SCHEMA, title="fresh"))   # not yet in any cache
    t0 = time.perf_counter()
    backend.matcher(spec)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    backend.matcher(spec)
    cached = time.perf_counter() - t0
    return {"tokenizer_setup_s": round(setup, 3), "matcher_cold_ms": round(1e3 * cold, 3),
            "matcher_cached_ms": round(1e3 * cached, 4)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_stack_flags(ap, model="smollm2-135m")
    ap.add_argument("--batches", default="1,8,32")
    add_load_flags(ap, max_tokens=128)
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--dtype", default="auto")
    add_out_flag(ap, type=Path)
    args = ap.parse_args(argv)
    cfg = EngineConfig(model=args.model, dtype=args.dtype, enable_overlap_schedule=args.overlap)
    engine = LLMEngine(cfg)
    result = {"model": args.model, "machine": platform.processor() or platform.machine(),
              "overlap": engine.overlap, "max_tokens": args.max_tokens,
              "compile": {**compile_times(), **worker_compile_times(engine)}, "batches": {}}
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    schema = dataclasses.replace(free, ignore_eos=False, structured=StructuredSpec.json_schema(SCHEMA))
    engine.generate(prompts(engine, 1), dataclasses.replace(free, max_tokens=4))   # warm-up
    for b in (int(x) for x in args.batches.split(",")):
        texts = prompts(engine, b)
        row = {"free": run(engine, texts, free), "schema": run(engine, texts, schema)}
        f, s = row["free"]["tpot_ms"], row["schema"]["tpot_ms"]
        row["tpot_overhead_pct"] = round(100 * (s / f - 1), 2) if f and s else None
        result["batches"][str(b)] = row
        print(json.dumps({b: row}), flush=True)
    engine.check_idle()
    engine.close()
    print(json.dumps(result, indent=2))
    if args.out:
        write_result(args.out, result, tool="tandem.bench.structured")


if __name__ == "__main__":
    main()
