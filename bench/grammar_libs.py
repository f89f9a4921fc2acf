"""Grammar libraries compared on SmolLM2's 49k vocabulary: per-token mask cost and compile time for
a nested JSON Schema (the measurement behind docs/structured-output.md's choice).

    python -m tandem.bench.grammar_libs --out bench/results/grammar_libs.json
    python -m tandem.bench.grammar_libs --libs llguidance            # only the installed ones are measured

For each library: the tokenizer set-up (once per worker), a cold compile (a fresh compiler, first
use of the schema, through the first mask), a cached start (what a second request with the same
schema costs: the library's own cache, or a copy of a compiled matcher), and the mask of every step
while a matcher walks a valid instance's tokens (mean, p50, p99 over the steps; each step computes
the mask, then consumes the token). xgrammar and outlines-core are optional here (xgrammar needs
torch; install both with --no-deps into a side folder and pass --path to measure them).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from tandem.bench.flags import add_out_flag, add_stack_flags
from tandem.bench.results import write_result

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                        "required": ["lat", "lon"], "additionalProperties": False},
            },
            "required": ["street", "city", "zip", "geo"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}},
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "status": {"enum": ["open", "shipped", "cancelled"]},
                    "items": {"type": "array", "items": {
                        "type": "object",
                        "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"},
                                       "price": {"type": "number"}},
                        "required": ["sku", "qty", "price"], "additionalProperties": False}},
                },
                "required": ["id", "status", "items"],
                "additionalProperties": False,
            },
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "address", "tags", "orders", "active"],
    "additionalProperties": False,
}

INSTANCE = {
    "name": "Ada Lovelace", "age": 36, "email": "ada@example.com",
    "address": {"street": "12 St James's Square", "city": "London", "zip": "01234",
                "geo": {"lat": 51.5074, "lon": -0.1357}},
    "tags": ["mathematics", "analytical engine", "poetry"],
    "orders": [
        {"id": 1, "status": "shipped", "items": [{"sku": "NOTE-G", "qty": 2, "price": 12.5},
                                                 {"sku": "BERN-1", "qty": 1, "price": 3.25}]},
        {"id": 2, "status": "open", "items": [{"sku": "LOOM-7", "qty": 10, "price": 0.99}]},
    ],
    "active": False,
}


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"mean_us": round(1e6 * statistics.fmean(xs), 2), "p50_us": round(1e6 * xs[len(xs) // 2], 2),
            "p99_us": round(1e6 * xs[min(len(xs) - 1, int(0.99 * len(xs)))], 2), "steps": len(xs)}


def bench_llguidance(tok_path: Path, ids: list[int], text: str) -> dict:
    import llguidance
    import numpy as np

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(tok_path.read_text())
    setup = time.perf_counter() - t0
    mask = np.zeros((tok.vocab_size + 31) // 32, dtype=np.int32)

    def start():
        g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
        m = llguidance.LLMatcher(tok, g)
        assert not m.is_error(), m.get_error()
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        return m

    t0 = time.perf_counter()
    proto = start()
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    recompiled = start()
    recompile = time.perf_counter() - t0
    del recompiled
    t0 = time.perf_counter()
    m = proto.deep_copy()
    m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    cached = time.perf_counter() - t0
    m = proto.deep_copy()
    steps = []
    for t in ids:
        t0 = time.perf_counter()
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        steps.append(time.perf_counter() - t0)
        assert (mask[t // 32] >> (t % 32)) & 1, f"llguidance refuses token {t}"
        assert m.consume_token(t), m.get_error()
    assert m.is_accepting()
    return {"version": _version("llguidance"), "tokenizer_setup_s": round(setup, 4), "compile_cold_s": round(cold, 4),
            "compile_again_s": round(recompile, 4), "start_cached_s": round(cached, 6), "mask": _stats(steps)}


def bench_xgrammar(tok_path: Path, ids: list[int], text: str) -> dict:
    import torch
    import transformers
    import xgrammar as xgr

    t0 = time.perf_counter()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_path))
    info = xgr.TokenizerInfo.from_huggingface(hf)
    setup = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1)

    t0 = time.perf_counter()
    cg = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    m = xgr.GrammarMatcher(cg)
    m.fill_next_token_bitmask(mask)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    cg = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))   # the compiler's own cache
    m = xgr.GrammarMatcher(cg)
    m.fill_next_token_bitmask(mask)
    cached = time.perf_counter() - t0
    steps = []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        steps.append(time.perf_counter() - t0)
        assert (int(mask[0, t // 32]) >> (t % 32)) & 1, f"xgrammar refuses token {t}"
        assert m.accept_token(t)
    del torch
    return {"version": _version("xgrammar"), "tokenizer_setup_s": round(setup, 4), "compile_cold_s": round(cold, 4),
            "start_cached_s": round(cached, 6), "mask": _stats(steps)}


def bench_outlines_core(tok_path: Path, ids: list[int], text: str) -> dict:
    import outlines_core as oc

    t0 = time.perf_counter()
    vocab = oc.Vocabulary(_eos_id(tok_path), _byte_vocab(tok_path))
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    regex = oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = oc.Index(regex, vocab)
    guide = oc.Guide(index)
    guide.get_tokens()
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    guide = oc.Guide(index)
    guide.get_tokens()
    cached = time.perf_counter() - t0
    steps = []
    for t in ids:
        t0 = time.perf_counter()
        allowed = guide.get_tokens()
        steps.append(time.perf_counter() - t0)
        assert t in allowed, f"outlines-core refuses token {t}"
        guide.advance(t)
    return {"version": _version("outlines_core"), "tokenizer_setup_s": round(setup, 4),
            "compile_cold_s": round(cold, 4), "start_cached_s": round(cached, 6), "mask": _stats(steps)}


def _eos_id(tok_path: Path) -> int:
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(tok_path)).token_to_id("<|im_end|>")


def _byte_vocab(tok_path: Path) -> dict[bytes, list[int]]:
    """Token bytes -> ids for a byte-level BPE vocabulary (special tokens left out)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tok_path))
    # GPT-2's byte <-> printable-character table.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    decode = {chr(c): b for b, c in zip(bs, cs, strict=True)}
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    out: dict[bytes, list[int]] = {}
    for s, i in tok.get_vocab().items():
        if s not in special:
            out.setdefault(bytes(decode[ch] for ch in s), []).append(i)
    return out


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist.replace("_", "-"))
    except PackageNotFoundError:
        return "?"


LIBS = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines_core": bench_outlines_core}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_stack_flags(ap, model="smollm2-135m", helps={"model": "model alias or folder (its tokenizer.json is used)"})
    ap.add_argument("--libs", default=",".join(LIBS))
    ap.add_argument("--path", action="append", default=[], help="extra sys.path entry (libraries installed aside)")
    add_out_flag(ap, type=Path)
    args = ap.parse_args(argv)
    sys.path[:0] = args.path
    from tokenizers import Tokenizer

    from tandem.engine.models.source import resolve_model

    folder = Path(resolve_model(args.model))
    tok_path = folder / "tokenizer.json"
    text = json.dumps(INSTANCE, separators=(",", ":"))
    ids = Tokenizer.from_file(str(tok_path)).encode(text, add_special_tokens=False).ids
    result = {"model": args.model, "vocab": Tokenizer.from_file(str(tok_path)).get_vocab_size(), "instance_tokens": len(ids),
              "machine": platform.processor() or platform.machine(), "libs": {}}
    for name in args.libs.split(","):
        try:
            result["libs"][name] = LIBS[name](tok_path, ids, text)
        except ImportError as e:
            result["libs"][name] = {"skipped": f"not installed ({e})"}
        except Exception as e:   # a library that cannot do the schema is a result too
            result["libs"][name] = {"failed": f"{type(e).__name__}: {e}"}
    print(json.dumps(result, indent=2))
    if args.out:
        write_result(args.out, result, tool="tandem.bench.grammar_libs")


if __name__ == "__main__":
    main()
