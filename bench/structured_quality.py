"""What a grammar does to the answers, not to the speed: strict JSON Schema requests through the chat
template, no JSON whitespace but the separators (the default) against the model's own, bounded
(`--enable-any-whitespace`), greedy and at temperature 0.3. Per setting: completions that ended by
themselves (EOS) with an object that validates against its schema, those cut at max_tokens, and keys
the schema does not name (must be 0: objects are closed).

    python -m tandem.bench.structured_quality --out bench/results/structured_quality.json   # ~3 min, 2 cores

One engine per whitespace mode (SmolLM2 by default, fp32 as issue [24]'s held-out check), 24 prompts
over 6 schemas (nested objects, arrays, enums, numbers), all in one batch per temperature; T=0.3 runs
`--seeds` seeds per prompt. `--vllm`: the same requests, side by side, to vLLM's CPU backend (`make
vllm-venv`) over its chat completions API (`response_format` json_schema, strict; its default
structured-output backend; the same chat template, from the same model folder), scored the same way.
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jsonschema

from tandem.bench.flags import add_load_flags, add_out_flag
from tandem.bench.results import write_result
from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.outputs import FinishReason
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import StructuredSpec


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


SCHEMAS = {
    "person": _obj({"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}),
    "book": _obj({"title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"},
                  "genres": {"type": "array", "items": {"type": "string"}}}),
    "order": _obj({"id": {"type": "integer"}, "customer": _obj({"name": {"type": "string"},
                                                                "email": {"type": "string"}}),
                   "items": {"type": "array", "items": _obj({"product": {"type": "string"},
                                                                           "quantity": {"type": "integer"}})}}),
    "weather": _obj({"city": {"type": "string"}, "temperature_c": {"type": "number"},
                     "condition": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow"]}}),
    "movie": _obj({"title": {"type": "string"}, "director": {"type": "string"}, "rating": {"type": "number"},
                   "cast": {"type": "array", "items": {"type": "string"}}}),
    "recipe": _obj({"name": {"type": "string"}, "servings": {"type": "integer"},
                    "ingredients": {"type": "array", "items": _obj({"item": {"type": "string"},
                                                                                 "amount": {"type": "string"}})}}),
}
ASKS = {
    "person": ["Describe a software engineer who lives in Lisbon.", "Tell me about a retired teacher from Rome.",
               "Invent a student who lives in Berlin.", "Give me a fictional doctor from Cairo."],
    "book": ["Tell me about the novel 1984.", "Describe a fantasy book you like.",
             "Give me details of Pride and Prejudice.", "Invent a science fiction novel."],
    "order": ["Create an online order for two books and a lamp.", "Make up an order from a coffee shop.",
              "Write an order record for office supplies.", "Invent a grocery order for a family."],
    "weather": ["What is the weather like in Oslo today?", "Report the weather in Madrid.",
                "Describe today's weather in Tokyo.", "Give a weather report for Sydney."],
    "movie": ["Tell me about the movie Inception.", "Describe a classic western film.",
              "Give me details about Titanic.", "Invent a comedy movie."],
    "recipe": ["Give me a recipe for pancakes.", "How do I make a tomato soup?",
               "Share a simple pasta recipe.", "Write a recipe for guacamole."],
}


def requests(engine: LLMEngine) -> list[tuple[str, str]]:
    """(schema name, chat prompt) for every ask."""
    out = []
    for name, asks in ASKS.items():
        for ask in asks:
            msgs = [{"role": "user", "content": f"{ask} Answer in JSON."}]
            out.append((name, engine.tokenizer.apply_chat_template(msgs)))
    return out


def unknown_keys(value, schema: dict) -> int:
    """Keys of `value` (recursively) that its schema's objects do not name."""
    if isinstance(value, dict) and schema.get("type") == "object":
        props = schema.get("properties", {})
        return sum(1 for k in value if k not in props) + sum(unknown_keys(v, props[k]) for k, v in value.items()
                                                             if k in props)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return sum(unknown_keys(v, schema["items"]) for v in value)
    return 0


def score(results, names: list[str]) -> dict:
    ended = valid = cut = extra = failed = 0
    for r, name in zip(results, names, strict=True):
        if r.finish_reason is FinishReason.LENGTH:
            cut += 1
            continue
        if r.finish_reason is FinishReason.ABORT:   # the server never answered (HTTP peers only)
            failed += 1
            continue
        ended += 1
        try:
            obj = json.loads(r.text)
            jsonschema.validate(obj, SCHEMAS[name])
            valid += 1
            extra += unknown_keys(obj, SCHEMAS[name])
        except (ValueError, jsonschema.ValidationError):
            pass
    n = len(names)
    return {"completions": n, "ended_valid": valid, "ended_invalid": ended - valid, "cut_at_max_tokens": cut,
            "failed": failed,
            "ended_valid_share": valid / n, "unknown_keys": extra,
            "mean_output_tokens": sum(len(r.token_ids) for r in results) / n}


@dataclass
class HttpResult:
    """A chat completion from an HTTP server, as `score` reads an engine's result."""

    text: str
    finish_reason: FinishReason
    token_ids: list


def vllm_rows(args, asks: list[tuple[str, str]]) -> list[dict]:
    """The same requests to vLLM's CPU backend (chat messages: it applies the folder's chat template)."""
    from tandem.bench.serve.sweep import SweepConfig, VllmServe

    server = VllmServe(SweepConfig(model=args.model, dtype=args.dtype, vllm_kv_cache_gb=1))
    endpoint = server.start()
    try:
        def one(name: str, ask: str, temperature: float, seed: int | None) -> HttpResult:
            body = {"model": endpoint.model, "max_tokens": args.max_tokens, "temperature": temperature,
                    "messages": [{"role": "user", "content": ask}],
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}},
                    **({"seed": seed} if seed is not None else {})}
            req = urllib.request.Request(endpoint.base_url + "/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=300) as r:
                    out = json.loads(r.read())
            except OSError as e:    # counted as not ended (a request the server lost), not fatal to the run
                print(f"vLLM request failed: {e}", flush=True)
                return HttpResult("", FinishReason.ABORT, [])
            choice = out["choices"][0]
            reason = FinishReason.LENGTH if choice["finish_reason"] == "length" else FinishReason.STOP
            return HttpResult(choice["message"]["content"] or "", reason,
                              [0] * out["usage"]["completion_tokens"])

        rows = []
        for temperature, seeds in ((0.0, [None]), (0.3, [args.seed + i for i in range(args.seeds)])):
            batch = [(name, ask, seed) for name, ask in asks for seed in seeds]
            with ThreadPoolExecutor(8) as pool:
                results = list(pool.map(lambda b, t=temperature: one(b[0], b[1], t, b[2]), batch))
            rows.append(_row("vLLM CPU backend (its default)", temperature, results, [n for n, _, _ in batch]))
        return rows
    finally:
        server.close()


def _row(label: str, temperature: float, results, names: list[str]) -> dict:
    row = {"whitespace": label, "temperature": temperature, **score(results, names), "sample": results[0].text[:200]}
    print(f"{row['whitespace']:>32} T={temperature}: ended valid {row['ended_valid']}/{row['completions']}, "
          f"cut {row['cut_at_max_tokens']}, invalid {row['ended_invalid']}, unknown keys "
          f"{row['unknown_keys']}, {row['mean_output_tokens']:.0f} tokens", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_load_flags(ap, seed=0, max_tokens=256)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per prompt at temperature 0.3")
    ap.add_argument("--vllm", action="store_true", help="the same requests to vLLM's CPU backend, side by side")
    ap.add_argument("--no-tandem", action="store_true", help="with --vllm: vLLM's rows only")
    add_out_flag(ap)
    args = ap.parse_args()
    rows = []
    for compact in () if args.no_tandem else (False, True):
        engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, enable_any_whitespace=not compact))
        reqs = requests(engine)
        for temperature, seeds in ((0.0, [None]), (0.3, [args.seed + i for i in range(args.seeds)])):
            batch = [(name, text, seed) for name, text in reqs for seed in seeds]
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=seed,
                                     structured=StructuredSpec.json_schema(SCHEMAS[name], strict=True))
                      for name, _, seed in batch]
            results = engine.generate([text for _, text, _ in batch], params)
            rows.append(_row("none (default)" if compact else "model's own, bounded (--enable-any-whitespace)",
                             temperature, results, [name for name, _, _ in batch]))
        engine.close()
    if args.vllm:
        rows += vllm_rows(args, [(name, f"{ask} Answer in JSON.") for name, asks in ASKS.items() for ask in asks])
    if args.out:
        write_result(args.out, {"bench": "structured_quality", "model": args.model, "dtype": args.dtype,
                                "max_tokens": args.max_tokens, "rows": rows}, tool="tandem.bench.structured_quality")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
