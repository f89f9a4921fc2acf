"""Issue [17]'s P/D hand-off cost: TTFT with vs without a JSON Schema in 1P1D, through the gateway.

    flock /tmp/tandem-bench.lock .venv/bin/python -m tandem.bench.structured_pd --modes disagg,colocated
    python -m tandem.bench.structured_pd --prompts 4 --max-tokens 16 --num-warmups 1        # a smoke run

Each mode starts its own `tandem up` (bench/serve/sweep.py's deployments, one at a time):

    disagg     `tandem up --mode disagg --prefill 1 --decode 1`
    colocated  `tandem up --mode colocated`: the same requests without a hand-off, so the difference
               of the two modes' schema-minus-free TTFT is what the hand-off adds for a schema

Through the gateway with the official `openai` client, streamed chat completions, greedy, ONE AT A
TIME (TTFT is then prefill + hand-off + grammar, never queueing). Per mode, in order:
  1. warm-up free-text requests (not measured);
  2. the first schema request (`first_schema`): the router, P and D each compile the grammar, and each
     worker builds its grammar tokenizer (lazy, ~0.3 s on a 2-core box);
  3. one request with a second, never-seen schema (`new_schema`): compile only;
  4. the measured set: every prompt once as free text and once with `response_format=json_schema`
     (a nested pydantic model's schema, strict), the same max_tokens, the order alternating per prompt
     (free first, then schema first) so drift falls on both alike.
Every request's system message starts with its own tag, so no request is served from another's prefix
cache. Free text ignores EOS and runs max_tokens (--no-ignore-eos: it may stop early); a schema
request ends when its object is complete, so TPOT (per request: (E2E - TTFT) / (tokens - 1)) is what
compares, not E2E.

Writes one JSON (per mode: the `tandem up` command, every request, and the summary) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.bench.flags import add_load_flags, add_out_flag, add_progress_flags, add_stack_flags
from tandem.bench.results import write_result
from tandem.bench.serve.metrics import percentile
from tandem.bench.serve.serve import machine_info
from tandem.bench.serve.sweep import (
    Endpoint,
    SweepConfig,
    TandemUp,
    _terminate_as_exit,
    auto_dtype,
    measure_deployment,
)

log = logging.getLogger(__name__)

MODES: dict[str, tuple[str, ...]] = {
    "disagg": ("--mode", "disagg", "--prefill", "1", "--decode", "1"),
    "colocated": ("--mode", "colocated"),
}
FREE, SCHEMA = "free", "schema"

Short = Annotated[str, Field(max_length=24)]   # SmolLM2 given an unbounded string may write until max_tokens


class Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")   # additionalProperties false (strict wants it)


class Address(Closed):
    city: Short
    country: Short


class Person(Closed):
    name: Short
    age: int = Field(ge=0, le=120)
    job: Short
    address: Address
    hobbies: list[Short] = Field(max_length=3)


class Pet(Closed):                               # the never-seen second schema
    name: Short
    species: Short
    owner: Address


WHO = ["a baker in Paris", "a retired pilot from Texas", "a young painter in Kyoto", "a chess champion",
       "a nurse in Lagos", "a fisherman in Norway", "a student in Cairo", "a chef from Lima", "an astronaut",
       "a violinist in Vienna", "a farmer in Kenya", "a programmer in Berlin", "a teacher in Mumbai",
       "a surfer in Sydney", "a librarian in Dublin", "a doctor in Toronto", "a potter in Mexico City",
       "a cyclist from Milan", "a poet in Santiago", "a gardener in Seoul", "a taxi driver in New York",
       "a marine biologist in Cape Town", "a jazz drummer in New Orleans", "a beekeeper in rural Poland"]
ASK = ["Describe {} as a person.", "Tell me about {}: their name, age, job, where they live and what they enjoy.",
       "Invent a short profile of {}.", "Who might {} be? Give a few details about their life and hobbies."]


def prompts(n: int) -> list[str]:
    """`n` varied user prompts (who x phrasing; lengths differ)."""
    return [ASK[i % len(ASK)].format(WHO[i % len(WHO)]) + ("" if i < len(WHO) else f" (#{i})") for i in range(n)]


def order(n: int) -> list[tuple[int, str]]:
    """The measured sequence: each prompt free and with the schema, alternating which goes first."""
    return [(i, kind) for i in range(n) for kind in ((FREE, SCHEMA) if i % 2 == 0 else (SCHEMA, FREE))]


def response_format(model: type[BaseModel]) -> dict:
    """What `chat.completions.parse(response_format=model)` sends: the model's schema, strict."""
    return {"type": "json_schema", "json_schema": {"name": model.__name__, "schema": model.model_json_schema(),
                                                   "strict": True}}


@dataclass(frozen=True)
class Sample:
    """One request as the client saw it (seconds)."""

    kind: str                  # FREE or SCHEMA
    prompt: int                # index in prompts(); -1 for warm-ups and the cold schema requests
    ttft_s: float | None       # to the first chunk with content
    e2e_s: float
    output_tokens: int         # usage.completion_tokens (content chunks if the server sent no usage)
    finish_reason: str | None = None
    valid: bool | None = None  # schema requests that stopped: the output parses as the model
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.ttft_s is not None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


# --- the report (pure) ---

def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def _p(values: list[float], q: float) -> float | None:
    return round(percentile(values, q) * 1e3, 3) if values else None


def kind_stats(samples: list[Sample]) -> dict:
    ok = [s for s in samples if s.ok]
    ttft, tpot = [s.ttft_s for s in ok], [s.tpot_s for s in ok if s.tpot_s is not None]
    return {"requests": len(samples), "failed": len(samples) - len(ok),
            "ttft_ms_p50": _p(ttft, 50), "ttft_ms_p90": _p(ttft, 90), "tpot_ms_p50": _p(tpot, 50),
            "e2e_ms_p50": _p([s.e2e_s for s in ok], 50),
            "output_tokens_mean": round(sum(s.output_tokens for s in ok) / len(ok), 1) if ok else None,
            "finish_reasons": dict(Counter(str(s.finish_reason) for s in ok)),
            "valid": sum(1 for s in ok if s.valid), "cut_or_invalid": sum(1 for s in ok if s.valid is False)}


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def paired_ttft_diffs(samples: list[Sample]) -> list[float]:
    """Schema minus free TTFT of the same prompt (seconds), for prompts where both succeeded."""
    by = {(s.prompt, s.kind): s.ttft_s for s in samples if s.ok}
    return [by[i, SCHEMA] - by[i, FREE] for i in sorted({p for p, _ in by}) if (i, FREE) in by and (i, SCHEMA) in by]


def cold_stats(s: Sample | None, cached_ttft_ms_p50: float | None) -> dict | None:
    if s is None:
        return None
    ttft = _ms(s.ttft_s)
    return {"ttft_ms": ttft, "tpot_ms": _ms(s.tpot_s), "e2e_ms": _ms(s.e2e_s), "output_tokens": s.output_tokens,
            "finish_reason": s.finish_reason, "error": s.error, "over_cached_ttft_p50_ms": _diff(ttft, cached_ttft_ms_p50)}


def mode_summary(samples: list[Sample], first_schema: Sample | None = None, new_schema: Sample | None = None) -> dict:
    """The measured set's TTFT/TPOT per kind, schema minus free, and the cold schema requests."""
    free = kind_stats([s for s in samples if s.kind == FREE])
    schema = kind_stats([s for s in samples if s.kind == SCHEMA])
    paired = paired_ttft_diffs(samples)
    f_tpot, s_tpot = free["tpot_ms_p50"], schema["tpot_ms_p50"]
    return {
        FREE: free, SCHEMA: schema,
        "ttft_p50_diff_ms": _diff(schema["ttft_ms_p50"], free["ttft_ms_p50"]),
        "ttft_p90_diff_ms": _diff(schema["ttft_ms_p90"], free["ttft_ms_p90"]),
        "ttft_paired_diff_ms_p50": _p(paired, 50),
        "tpot_p50_overhead_pct": round(100 * (s_tpot / f_tpot - 1), 2) if f_tpot and s_tpot else None,
        "first_schema": cold_stats(first_schema, schema["ttft_ms_p50"]),
        "new_schema": cold_stats(new_schema, schema["ttft_ms_p50"]),
    }


def handoff_share(summaries: dict[str, dict]) -> float | None:
    """What a schema adds to TTFT under P/D beyond what it adds co-located (ms, p50 of the paired
    differences); None unless both modes were measured."""
    d, c = summaries.get("disagg"), summaries.get("colocated")
    return None if d is None or c is None else _diff(d["ttft_paired_diff_ms_p50"], c["ttft_paired_diff_ms_p50"])


def _f(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def table(summaries: dict[str, dict]) -> str:
    """Aligned text: one row per mode and kind, then schema - free, then the cold schema requests."""
    head = f"{'mode':<10} {'kind':<14} {'n':>3} {'TTFT p50':>9} {'TTFT p90':>9} {'TPOT p50':>9} {'out tok':>7}  finish"
    lines = [head + "   (ms)", "-" * len(head)]
    for mode, s in summaries.items():
        for kind in (FREE, SCHEMA):
            k = s[kind]
            fin = ", ".join(f"{r} {n}" for r, n in sorted(k["finish_reasons"].items()))
            lines.append(f"{mode:<10} {kind:<14} {k['requests'] - k['failed']:>3} {_f(k['ttft_ms_p50']):>9} "
                         f"{_f(k['ttft_ms_p90']):>9} {_f(k['tpot_ms_p50']):>9} {_f(k['output_tokens_mean']):>7}  "
                         f"{fin}" + (f", failed {k['failed']}" if k["failed"] else ""))
        tpot = s["tpot_p50_overhead_pct"]
        lines.append(f"{mode:<10} {'schema - free':<14} {'':>3} {_f(s['ttft_p50_diff_ms'], '+.1f'):>9} "
                     f"{_f(s['ttft_p90_diff_ms'], '+.1f'):>9} {_f(tpot, '+.1f') + '%':>9}  "
                     f"paired TTFT p50 {_f(s['ttft_paired_diff_ms_p50'], '+.1f')}")
    lines.append("")
    for mode, s in summaries.items():
        for name, what in (("first_schema", "first schema request"), ("new_schema", "a new schema")):
            c = s[name]
            if c is not None:
                lines.append(f"{mode}: {what}: TTFT {_f(c['ttft_ms'])} ms "
                             f"({_f(c['over_cached_ttft_p50_ms'], '+.1f')} over the cached p50), "
                             f"TPOT {_f(c['tpot_ms'])} ms" + (f", error {c['error']}" if c["error"] else ""))
    share = handoff_share(summaries)
    if share is not None:
        lines.append(f"P/D hand-off's share of a schema's TTFT cost (disagg - colocated, paired p50): {share:+.1f} ms")
    return "\n".join(lines)


# --- the run ---

@dataclass(frozen=True)
class StructuredPDConfig:
    model: str = "smollm2-135m"
    modes: tuple[str, ...] = ("disagg",)
    prompts: int = 24
    max_tokens: int = 128
    num_warmups: int = 2
    ignore_eos: bool = True              # free text runs max_tokens
    dtype: str = "auto"
    up_args: tuple[str, ...] = ()        # extra `tandem up` flags (transfer backend, overlap, ...)
    start_timeout_s: float = 600.0
    request_timeout_s: float = 300.0
    out: str = "bench/results/structured_pd.json"
    progress: bool = True


def parse_modes(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in MODES]
    if bad or not names:
        raise ValueError(f"unknown mode(s) {', '.join(bad) or '(none)'}: choose from {', '.join(MODES)}")
    return names


def messages(tag: str, user: str) -> list[dict]:
    # The tag first: no request's prompt shares more than the template's first tokens with another's.
    return [{"role": "system", "content": f"[{tag}] You are a helpful assistant."}, {"role": "user", "content": user}]


def send(client, model: str, msgs: list[dict], cfg: StructuredPDConfig, kind: str, prompt: int,
         schema: type[BaseModel] = Person) -> Sample:
    import openai

    kwargs: dict = {"model": model, "messages": msgs, "max_tokens": cfg.max_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
    if kind == SCHEMA:
        kwargs["response_format"] = response_format(schema)
    elif cfg.ignore_eos:
        kwargs["extra_body"] = {"ignore_eos": True}
    first, parts, usage, finish = None, [], None, None
    t0 = time.perf_counter()
    try:
        for chunk in client.chat.completions.create(**kwargs):
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for c in chunk.choices:
                if c.delta.content:
                    if first is None:
                        first = time.perf_counter()
                    parts.append(c.delta.content)
                finish = c.finish_reason or finish
    except openai.OpenAIError as e:
        return Sample(kind, prompt, None, time.perf_counter() - t0, 0, error=f"{type(e).__name__}: {e}"[:300])
    end = time.perf_counter()
    valid = None
    if kind == SCHEMA:
        try:
            schema.model_validate_json("".join(parts))
            valid = finish == "stop"
        except ValidationError:
            valid = False
    return Sample(kind, prompt, None if first is None else first - t0, end - t0,
                  usage if usage is not None else len(parts), finish, valid)


def run_mode(ep: Endpoint, mode: str, cfg: StructuredPDConfig, echo=print) -> dict:
    import openai

    texts = prompts(cfg.prompts)

    def show(label: str, s: Sample) -> None:
        if cfg.progress:
            echo(f"  {mode} {label:<16} TTFT {_f(_ms(s.ttft_s))} ms, E2E {_f(_ms(s.e2e_s))} ms, "
                 f"{s.output_tokens} tok, {s.finish_reason}" + (f", valid {s.valid}" if s.valid is not None else "")
                 + (f", ERROR {s.error}" if s.error else ""))

    with openai.OpenAI(base_url=ep.base_url + "/v1", api_key="unused", max_retries=0,
                       timeout=cfg.request_timeout_s) as client:
        for i in range(cfg.num_warmups):
            show(f"warm-up {i}", send(client, ep.model, messages(f"warm-up {i}", texts[i % len(texts)]), cfg, FREE, -1))
        first = send(client, ep.model, messages("cold 1", "Describe a sailor in Lisbon as a person."), cfg, SCHEMA, -1)
        show("first schema", first)
        new = send(client, ep.model, messages("cold 2", "Describe the pet of a sailor in Lisbon."), cfg, SCHEMA, -1,
                   schema=Pet)
        show("new schema", new)
        samples = []
        for i, kind in order(len(texts)):
            samples.append(send(client, ep.model, messages(f"{kind} {i}", texts[i]), cfg, kind, i))
            show(f"{kind} {i}", samples[-1])
    return {"summary": mode_summary(samples, first, new), "first_schema_request": dataclasses.asdict(first),
            "new_schema_request": dataclasses.asdict(new), "requests": [dataclasses.asdict(s) for s in samples]}


def run(cfg: StructuredPDConfig, argv: list[str], echo=print) -> dict:
    dtype = cfg.dtype
    if dtype == "auto":
        dtype = auto_dtype(cfg.model)
        echo(f"--- dtype auto: {dtype} (what Tandem picks for this model here)")
    sweep_cfg = SweepConfig(model=cfg.model, dtype=dtype, up_args=cfg.up_args, start_timeout_s=cfg.start_timeout_s)
    out = Path(cfg.out)
    results: dict = {"tool": "python -m tandem.bench.structured_pd", "command": shlex.join(["python", "-m", "tandem.bench.structured_pd",
                                                                                     *argv]),
                     "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(),
                     "config": dataclasses.asdict(cfg), "dtype": dtype, "schema": Person.model_json_schema(),
                     "modes": {}, "skipped": {}}
    with _terminate_as_exit():
        for mode in cfg.modes:
            dep = TandemUp(mode, list(MODES[mode]), sweep_cfg)
            entry, why = measure_deployment(dep, lambda ep, mode=mode: run_mode(ep, mode, cfg, echo), echo)
            if entry is None:
                results["skipped"][mode] = why
            else:
                results["modes"][mode] = entry
            # after each mode: a later crash keeps what was measured
            write_result(out, results, tool="tandem.bench.structured_pd")
    summaries = {m: e["summary"] for m, e in results["modes"].items()}
    results["handoff_share_ms"] = handoff_share(summaries)
    results["table"] = table(summaries)
    write_result(out, results, tool="tandem.bench.structured_pd")
    echo(results["table"])
    for mode, why in results["skipped"].items():
        echo(f"skipped {mode}: {why.splitlines()[0] if why else ''}")
    echo(f"results: {out}")
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    d = StructuredPDConfig()
    p = argparse.ArgumentParser(prog="python -m tandem.bench.structured_pd", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stack_flags(p, model=d.model)
    p.add_argument("--modes", default=",".join(d.modes), help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--prompts", type=int, default=d.prompts, help="prompts in the measured set (each sent twice)")
    add_load_flags(p, max_tokens=d.max_tokens, num_warmups=d.num_warmups)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=d.ignore_eos,
                   help="free-text requests run max_tokens")
    p.add_argument("--dtype", default=d.dtype)
    add_stack_flags(p, up_args="", start_timeout=d.start_timeout_s,
                    helps={"up_args": "extra `tandem up` flags for every mode"})
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s)
    add_out_flag(p, d.out)
    add_progress_flags(p)
    p.add_argument("--log-level", default="WARNING")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = StructuredPDConfig(
            model=a.model, modes=parse_modes(a.modes), prompts=a.prompts, max_tokens=a.max_tokens,
            num_warmups=a.num_warmups, ignore_eos=a.ignore_eos, dtype=a.dtype, up_args=tuple(shlex.split(a.up_args)),
            start_timeout_s=a.start_timeout, request_timeout_s=a.request_timeout, out=a.out,
            progress=not a.no_progress)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = run(cfg, argv)
    return 0 if results["modes"] else 1


if __name__ == "__main__":
    sys.exit(main())
