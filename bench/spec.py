"""Speculative decoding: decode tokens/s with and without it, on a repetitive and a non-repetitive
workload, at batch 1 and 8 (engine level, one process, same model and threads for every run).

    flock /tmp/tandem-bench.lock python -m tandem.bench.spec --out bench/results/spec.json
    python -m tandem.bench.spec --algorithm draft --draft-model PATH     # a draft model instead of n-grams

Repetitive: chat requests that ask the model to repeat a code snippet with one change (the output
copies most of the prompt); quote: "repeat this quote exactly". Random: open-ended questions whose answers copy nothing. Decode tokens/s
counts the tokens of steps that ran no prefill, over those steps' wall time. Greedy, EOS honoured:
with and without speculation the outputs must be the same tokens (reported as `same_tokens`; bf16
verify and decode forwards may differ in the last bit, which can flip a near-tie).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import time

import torch

from tandem.bench.flags import add_load_flags, add_out_flag, add_stack_flags
from tandem.bench.results import write_result
from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams

CODE = [
    '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total += (v - m) ** 2
    return total / len(values)
''',
    '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1]
''',
    '''def read_config(path):
    with open(path) as f:
        lines = f.readlines()
    config = {}
    for line in lines:
        key, value = line.strip().split("=")
        config[key] = value
    return config
''',
]
CHANGES = ["Rename the variable `total` to `acc`.", "Add a docstring to every function.",
           "Rename `items` to `elements`.", "Use `values` as the parameter name everywhere."]
QUOTES = [
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair.",
    "We hold these truths to be self-evident, that all men are created equal, that they are endowed by their "
    "Creator with certain unalienable Rights, that among these are Life, Liberty and the pursuit of Happiness.",
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, "
    "and nothing particular to interest me on shore, I thought I would sail about a little and see the "
    "watery part of the world.",
]
TOPICS = ["the history of Rome", "how volcanoes form", "a recipe for bread", "the rules of chess",
          "why the sky is blue", "how to learn a language", "the life of bees", "a trip to Japan",
          "black holes", "the French revolution", "how vaccines work", "jazz music", "deep sea fish",
          "the printing press", "climate of deserts", "origami"]


def workload(engine: LLMEngine, kind: str, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        if kind == "repetitive":
            text = f"Here is some code:\n\n{rng.choice(CODE)}\n{rng.choice(CHANGES)} Reply with the whole code."
        elif kind == "quote":
            text = f"Repeat this quote exactly, twice:\n\n{rng.choice(QUOTES)}"
        else:
            text = f"Write a short essay about {rng.choice(TOPICS)}."
        chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        prompts.append(engine.tokenizer.encode(chat, add_special_tokens=False))
    return prompts


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    rids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    decode_s, decoded = 0.0, 0
    while engine.has_unfinished():
        is_decode = not engine.scheduler.waiting and not engine.scheduler.prefilling
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        for o in outs:
            tokens[o.rid].extend(o.token_ids)
        if is_decode:
            decode_s += dt
            decoded += sum(len(o.token_ids) for o in outs)
    engine.check_idle()
    return {"decode_tok_s": decoded / decode_s if decode_s else 0.0, "decode_s": decode_s,
            "decoded_tokens": decoded, "tokens": [tokens[r] for r in rids]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_stack_flags(ap, model="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--algorithm", default="ngram", choices=("ngram", "draft"))
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--workloads", default="repetitive,quote,random")
    add_load_flags(ap, max_tokens=160)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--disable-adaptive", action="store_true")
    add_out_flag(ap, "bench/results/spec.json")
    args = ap.parse_args()
    base = EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads, kv_cache_gb=0.5)
    spec_cfg = dataclasses.replace(base, speculative_algorithm=args.algorithm,
                                   speculative_draft_model=args.draft_model,
                                   speculative_num_draft_tokens=args.num_draft_tokens,
                                   speculative_adaptive=not args.disable_adaptive)
    engines = {"plain": LLMEngine(base), "spec": LLMEngine(spec_cfg)}
    results = []
    for kind in args.workloads.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = workload(engines["plain"], kind, batch, seed=batch)
            row = {"workload": kind, "batch": batch}
            for name in ("plain", "spec", "plain", "spec"):   # interleaved twice: the box is shared
                r = run(engines[name], prompts, args.max_tokens)
                row.setdefault(name, []).append(r["decode_tok_s"])
                row[f"{name}_tokens"] = r["tokens"]
            stats = engines["spec"].spec.stats
            row["same_tokens"] = row.pop("plain_tokens") == row.pop("spec_tokens")
            row["plain_tok_s"] = max(row.pop("plain"))
            row["spec_tok_s"] = max(row.pop("spec"))
            row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
            row["acceptance_rate"] = stats.acceptance_rate
            row["mean_accept_length"] = stats.mean_accept_length
            row["gate_enabled"] = engines["spec"].spec.gate.enabled
            engines["spec"].spec.stats = type(stats)(stats.num_draft_tokens)
            print(json.dumps(row), flush=True)
            results.append(row)
    out = {"config": {**vars(args), "torch_threads": torch.get_num_threads(), "cpu": platform.processor(),
                      "loadavg": os.getloadavg()}, "results": results}
    write_result(args.out, out, tool="tandem.bench.spec")


if __name__ == "__main__":
    main()
