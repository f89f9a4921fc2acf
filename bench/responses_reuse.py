"""A Responses API conversation (`previous_response_id`) under 1P1D: is its KV reused, and what does
that buy? Issue [24]'s measure, through the official `openai` client.

    python -m tandem.bench.responses_reuse --out bench/results/responses_reuse.json     # ~6 min, 2 cores

Per routing configuration (the default, where the router may prefill a turn on the decode worker that
holds the conversation; and `--local-prefill-max-tokens -1`, every prompt prefilled on the prefill
worker, which then fetches the earlier answers from the decode worker: --kv-reuse-policy auto), the
same `--conversations` conversations of `--turns` turns run one at a time, twice:

    chained   each turn `previous_response_id` + the new user message: the gateway rebuilds the
              conversation, whose KV the workers hold (prefix caches, and P fetching D's answers)
    fresh     each turn the whole conversation so far as `input` items, under a different random
              `instructions` line: the same lengths, nothing cached anywhere

TTFT = request sent -> first `response.output_text.delta`. Reported: TTFT p50/p90 of turns >= 2 per
mode, their ratio, and the prompt tokens served from cache (`usage.input_tokens_details.cached_tokens`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tandem.bench.flags import add_load_flags, add_out_flag
from tandem.bench.results import write_result
from tandem.bench.serve.backends import http_url
from tandem.bench.serve.procs import start_tandem_up

TOPICS = ["the moon", "bread", "rivers", "chess", "volcanoes", "bees", "glass", "trains", "tea", "maps",
          "clocks", "salt", "owls", "bridges", "paper", "snow", "copper", "whales", "wind", "ink"]
CONFIGS = {"default": [], "remote-prefill": ["--local-prefill-max-tokens", "-1"]}


def _turn(client, model: str, **kw) -> tuple[float, object]:
    t0, first, final = time.perf_counter(), None, None
    with client.responses.stream(model=model, max_output_tokens=kw.pop("max_tokens"), temperature=0, **kw) as s:
        for event in s:
            if first is None and event.type == "response.output_text.delta":
                first = time.perf_counter() - t0
            if event.type in ("response.completed", "response.incomplete"):   # incomplete: max_output_tokens
                final = event.response
    if final is None:
        raise RuntimeError("the stream ended without response.completed / response.incomplete")
    return first if first is not None else time.perf_counter() - t0, final


def conversation(client, model: str, rng: random.Random, turns: int, max_tokens: int, chained: bool) -> list[dict]:
    rows, history, previous = [], [], None
    for t in range(turns):
        question = f"Tell me one surprising fact about {rng.choice(TOPICS)}, in two sentences."
        nonce = f"Session {rng.randrange(1 << 30)}."     # drawn in both modes: the same questions follow
        if chained:
            kw = {"input": question, "instructions": "You are a helpful assistant.",
                  **({"previous_response_id": previous} if previous else {})}
        else:   # a new first line every turn: nothing of the conversation is cached anywhere
            kw = {"input": [*history, {"role": "user", "content": question}], "instructions": nonce}
        ttft, final = _turn(client, model, max_tokens=max_tokens, **kw)
        usage = final.usage
        cached = usage.input_tokens_details.cached_tokens if usage.input_tokens_details else 0
        rows.append({"turn": t + 1, "ttft_s": ttft, "input_tokens": usage.input_tokens, "cached_tokens": cached})
        previous = final.id
        history += [{"role": "user", "content": question}, {"role": "assistant", "content": final.output_text}]
    return rows


def stats(rows: list[dict]) -> dict:
    later = [r for r in rows if r["turn"] >= 2]
    t = [r["ttft_s"] for r in later]
    return {"turn2plus_ttft_p50_ms": 1e3 * statistics.median(t),
            "turn2plus_ttft_p90_ms": 1e3 * statistics.quantiles(t, n=10)[-1],
            "turn2plus_input_tokens": sum(r["input_tokens"] for r in later),
            "turn2plus_cached_tokens": sum(r["cached_tokens"] for r in later)}


def main() -> None:
    from openai import OpenAI

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    add_load_flags(ap, seed=0, max_tokens=96)
    add_out_flag(ap)
    args = ap.parse_args()
    result: dict = {"bench": "responses_reuse", "config": vars(args), "runs": {}}
    for name in args.configs.split(","):
        proc, info = start_tandem_up(["--port", "0", "--quiet", "--ready-json", "--gateway-port", "0",
                                      "--mode", "disagg", "--prefill", "1", "--decode", "1", "--model", args.model,
                                      *CONFIGS[name]], timeout_s=300)
        try:
            client = OpenAI(base_url=http_url(info["gateway"]) + "/v1", api_key="none", max_retries=0)
            model = client.models.list().data[0].id
            run = {}
            for mode in ("chained", "fresh"):
                rng = random.Random(args.seed)   # the same questions in both modes
                rows = [r for _ in range(args.conversations)
                        for r in conversation(client, model, rng, args.turns, args.max_tokens, mode == "chained")]
                run[mode] = {"rows": rows, **stats(rows)}
                print(f"{name:>14} {mode:>7}: turn>=2 TTFT p50 {run[mode]['turn2plus_ttft_p50_ms']:.0f} ms, "
                      f"p90 {run[mode]['turn2plus_ttft_p90_ms']:.0f} ms; cached {run[mode]['turn2plus_cached_tokens']} "
                      f"of {run[mode]['turn2plus_input_tokens']} input tokens", flush=True)
            run["ttft_p50_chained_over_fresh"] = (run["chained"]["turn2plus_ttft_p50_ms"]
                                                  / run["fresh"]["turn2plus_ttft_p50_ms"])
            result["runs"][name] = run
        finally:
            proc.stop()
    if args.out:
        write_result(args.out, result, tool="tandem.bench.responses_reuse")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
