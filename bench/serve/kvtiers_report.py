"""What `python -m tandem.bench.serve.kvtiers` computes from its runs: the KV budget against the working set,
one summary per configuration, the issue's ratios (tiers / no tiers, best Tandem / vLLM), the warm
restart's first turns after the worker came back, and the figure. Pure Python (matplotlib only for the
figure), so it is unit-tested without servers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from tandem.bench.serve import plots
from tandem.bench.serve.metrics import percentile
from tandem.bench.serve.multiturn import Conversation

# The targets: turn >= 2 TTFT p50 with tiers <= 0.3x without; best Tandem goodput >= 1.5x vLLM's.
TTFT_RATIO_TARGET = 0.3
GOODPUT_RATIO_TARGET = 1.5
TIER_PAIRS = (("colo", "colo-tiers"), ("1p1d", "1p1d-tiers"))   # (without tiers, with tiers)


# ---- the KV budget ------------------------------------------------------------------------------

def conversation_tokens(conv: Conversation) -> int:
    """Tokens a conversation holds after its last answer, from its script: every user turn and every
    answer (an answer's text re-encoded inside the next prompt may differ by a token or so)."""
    return sum(len(t.ids) + t.output_len for t in conv.turns)


def script_working_set(convs: Sequence[Conversation]) -> int:
    """The workload's KV working set in tokens: every conversation's whole history, summed (what a cache
    must hold for no later turn to recompute anything)."""
    return sum(conversation_tokens(c) for c in convs)


def largest_request(convs: Sequence[Conversation]) -> int:
    """Prompt + output tokens of the longest single request (a conversation's last turn)."""
    return max(conversation_tokens(c) for c in convs)


def choose_l1_tokens(working_set: int, ratio: float, granule: int) -> int:
    """The largest multiple of `granule` that is at most `working_set / ratio` (so the working set is >=
    `ratio` x L1); `granule` is a multiple of both servers' page sizes, so both pools are exactly this."""
    if ratio <= 0 or granule < 1:
        raise ValueError("ratio must be > 0 and granule >= 1")
    return int(working_set / ratio) // granule * granule


def check_l1(l1_tokens: int, largest: int, granule: int) -> None:
    """A pool that cannot hold one request is a usage error, said before anything starts."""
    if l1_tokens < granule or l1_tokens % granule:
        raise ValueError(f"the L1 budget must be a positive multiple of {granule} tokens, got {l1_tokens}")
    if l1_tokens < largest:
        raise ValueError(f"an L1 of {l1_tokens} tokens cannot hold the largest request ({largest} tokens): "
                         "use more conversations (a larger working set) or set --l1-tokens")


def measured_working_set(requests: Iterable[Mapping]) -> int:
    """The working set the run actually built: per conversation, its largest prompt + answer (as the
    workload's tokenizer counted them), summed over conversations."""
    most: dict[int, int] = {}
    for r in requests:
        if r.get("conversation") is not None and r.get("success"):
            c = r["conversation"]
            most[c] = max(most.get(c, 0), r["prompt_len"] + r["output_tokens"])
    return sum(most.values())


def vllm_kv_args(l1_tokens: int, block_size: int, bytes_per_token: int) -> list[str]:
    """vLLM flags for a KV cache of exactly `l1_tokens` tokens on its CPU backend: a block count (its pool
    keeps one block back as the null block, hence + 1) and the bytes behind it (on CPU an explicit size
    also skips the RAM-fraction check; VLLM_CPU_KVCACHE_SPACE must be unset, it would override this).
    Prefix caching on, and cached prompt tokens reported in `usage` like Tandem's gateway does."""
    if l1_tokens % block_size:
        raise ValueError(f"the L1 budget {l1_tokens} is not a multiple of vLLM's block size {block_size}")
    blocks = l1_tokens // block_size + 1
    return ["--block-size", str(block_size), "--num-gpu-blocks-override", str(blocks),
            "--kv-cache-memory-bytes", str(blocks * block_size * bytes_per_token),
            "--enable-prefix-caching", "--enable-prompt-tokens-details"]


# ---- per configuration ---------------------------------------------------------------------------

def _p(stats: Mapping | None, q: str) -> float | None:
    v = (stats or {}).get("percentiles", {}).get(q)
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def cached_share(requests: Iterable[Mapping]) -> float | None:
    """Prompt tokens the server reported as served from cache / prompt tokens, over successful requests."""
    ok = [r for r in requests if r.get("success")]
    prompt = sum(r["prompt_len"] for r in ok)
    return sum(r["cached_tokens"] for r in ok) / prompt if prompt else None


def prompt_tokens_computed(requests: Iterable[Mapping]) -> dict:
    """Over successful requests: prompt tokens, and those the server computed (not reported cached: in
    1P1D what P neither held nor fetched from D)."""
    ok = [r for r in requests if r.get("success")]
    prompt = sum(r["prompt_len"] for r in ok)
    return {"prompt": prompt, "computed": prompt - sum(r["cached_tokens"] for r in ok)}


def config_summary(run: Mapping) -> dict:
    """One configuration's numbers from its run (`RateRun.to_dict(True)`: metrics, multi_turn, requests)."""
    m, mt, reqs = run["metrics"], run["multi_turn"], run.get("requests", [])
    return {
        "completed": m["completed"], "failed": m["failed"],
        "turns_not_sent": mt["turns_not_sent"],
        "ttft_turn_1_ms": {"p50": _p(mt["ttft_turn_1"], "p50"), "p99": _p(mt["ttft_turn_1"], "p99")},
        "ttft_turns_2_plus_ms": {"p50": _p(mt["ttft_turns_2_plus"], "p50"), "p99": _p(mt["ttft_turns_2_plus"], "p99")},
        "ttft_p50_by_turn_ms": {str(k): _p(t["ttft"], "p50") for k, t in mt["by_turn"].items()},
        "goodput": m["goodput"], "good_requests": m["good_requests"], "slo": m["slo"],
        "request_throughput": m["request_throughput"], "duration_s": m["duration_s"],
        "cached_prompt_share": m["cached_token_ratio"],
        "cached_prompt_share_turns_2_plus": cached_share(r for r in reqs if (r.get("turn") or 0) >= 2),
        "prompt_tokens_turns_2_plus": prompt_tokens_computed(r for r in reqs if (r.get("turn") or 0) >= 2),
        "measured_working_set_tokens": measured_working_set(reqs),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(summaries: Mapping[str, Mapping]) -> dict:
    """Turn >= 2 TTFT (p50, p99) with tiers / without, per pair measured; best Tandem goodput / vLLM's;
    each with the issue's target and a verdict."""
    out: dict = {"ttft_turns_2_plus_tiers_over_no_tiers": {}, "goodput_best_tandem_over_vllm": None}
    for off, on in TIER_PAIRS:
        if off in summaries and on in summaries:
            a, b = summaries[on]["ttft_turns_2_plus_ms"], summaries[off]["ttft_turns_2_plus_ms"]
            p50 = _ratio(a["p50"], b["p50"])
            out["ttft_turns_2_plus_tiers_over_no_tiers"][on.removesuffix("-tiers")] = {
                "p50": p50, "p99": _ratio(a["p99"], b["p99"]), "target_p50": TTFT_RATIO_TARGET,
                "met": None if p50 is None else p50 <= TTFT_RATIO_TARGET}
    if "1p1d-tiers" in summaries and "1p1d-tiers-no-d2p" in summaries:   # issue [22]'s KV both ways
        on, off = summaries["1p1d-tiers"], summaries["1p1d-tiers-no-d2p"]
        out["ttft_turns_2_plus_d2p_over_no_d2p"] = {
            q: _ratio(on["ttft_turns_2_plus_ms"][q], off["ttft_turns_2_plus_ms"][q]) for q in ("p50", "p99")}
    tandem = {n: s["goodput"] for n, s in summaries.items() if n != "vllm"}
    if tandem and "vllm" in summaries:
        best = max(tandem, key=tandem.get)
        r = _ratio(tandem[best], summaries["vllm"]["goodput"])
        out["goodput_best_tandem_over_vllm"] = {
            "best": best, "ratio": r, "tandem": tandem[best], "vllm": summaries["vllm"]["goodput"],
            "target": GOODPUT_RATIO_TARGET, "met": None if r is None else r >= GOODPUT_RATIO_TARGET}
    return out


def fmt(x, digits=0) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def summary_text(results: Mapping) -> str:
    """The terminal's (and the .md file's) view: the budget in one line, a row per configuration, the ratios."""
    b = results["kv_budget"]
    lines = [f"KV budget: L1 {b['l1_tokens']} tokens per worker, working set {b['working_set_tokens']} tokens "
             f"(script) = {fmt(b['working_set_over_l1'], 1)}x L1 "
             f"({'>=' if b['working_set_ge_target'] else 'BELOW'} {b['working_set_ratio_target']:g}x); "
             f"dtype {results['dtype']}; {results['slo_text']}",
             "| config | TTFT turns ≥ 2 p50 / p99 ms | TTFT turn 1 p50 / p99 ms | goodput req/s | "
             "cached prompt tokens (turns ≥ 2) | completed / failed |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, s in results["summaries"].items():
        t2, t1 = s["ttft_turns_2_plus_ms"], s["ttft_turn_1_ms"]
        share = s["cached_prompt_share_turns_2_plus"]
        lines.append(f"| {name} | {fmt(t2['p50'])} / {fmt(t2['p99'])} | {fmt(t1['p50'])} / {fmt(t1['p99'])} | "
                     f"{fmt(s['goodput'], 3)} | {'-' if share is None else f'{share:.0%}'} | "
                     f"{s['completed']} / {s['failed']} |")
    r = results["ratios"]
    for pair, v in r["ttft_turns_2_plus_tiers_over_no_tiers"].items():
        lines.append(f"{pair}: TTFT turns >= 2 p50 tiers / no tiers {fmt(v['p50'], 2)}x (p99 {fmt(v['p99'], 2)}x), "
                     f"target <= {v['target_p50']:g}x: {_verdict(v['met'])}")
    d2p = r.get("ttft_turns_2_plus_d2p_over_no_d2p")
    if d2p is not None:
        lines.append(f"1p1d-tiers: TTFT turns >= 2 with D->P reuse / without {fmt(d2p['p50'], 2)}x p50 "
                     f"({fmt(d2p['p99'], 2)}x p99)")
    g = r["goodput_best_tandem_over_vllm"]
    if g is not None:
        lines.append(f"goodput best Tandem ({g['best']}) / vLLM: {fmt(g['ratio'], 2)}x, "
                     f"target >= {g['target']:g}x: {_verdict(g['met'])}")
    return "\n".join(lines)


def _verdict(met: bool | None) -> str:
    return "not measured" if met is None else ("met" if met else "missed")


# ---- the warm restart ----------------------------------------------------------------------------

def first_turns_after(requests: Iterable[Mapping], back_ms: float) -> list[dict]:
    """Per conversation, its first turn >= 2 sent once the restarted worker was back (`sent_ms` >=
    `back_ms`, both from the run's start): what the restarted worker served from its tiers, or recomputed."""
    first: dict[int, Mapping] = {}
    for r in sorted(requests, key=lambda r: r["sent_ms"]):
        c = r.get("conversation")
        if c is None or c in first or r["sent_ms"] < back_ms or (r.get("turn") or 0) < 2:
            continue
        first[c] = r
    return [{"conversation": c, "turn": r["turn"], "success": r["success"], "ttft_ms": r["ttft_ms"],
             "prompt_len": r["prompt_len"], "cached_tokens": r["cached_tokens"],
             "cached_share": r["cached_tokens"] / r["prompt_len"] if r["prompt_len"] else None}
            for c, r in sorted(first.items())]


def restart_summary(turns: Sequence[Mapping]) -> dict:
    ok = [t for t in turns if t["success"] and t["ttft_ms"] is not None]
    ttfts = [t["ttft_ms"] for t in ok]
    prompt = sum(t["prompt_len"] for t in ok)
    return {"turns": len(turns), "completed": len(ok),
            "ttft_ms": {"p50": percentile(ttfts, 50) if ttfts else None, "p99": percentile(ttfts, 99) if ttfts else None},
            "cached_share": sum(t["cached_tokens"] for t in ok) / prompt if prompt else None}


def restart_comparison(with_l3: Sequence[Mapping], without: Sequence[Mapping]) -> dict:
    """The same (conversation, turn) pairs in both runs: TTFT with L3 / without, p50 of the per-pair ratios."""
    b = {(t["conversation"], t["turn"]): t for t in without if t["success"] and t["ttft_ms"]}
    rs = [t["ttft_ms"] / b[k]["ttft_ms"] for t in with_l3 if t["success"] and t["ttft_ms"] is not None
          and (k := (t["conversation"], t["turn"])) in b]
    return {"matched_turns": len(rs), "ttft_ratio_p50": percentile(rs, 50) if rs else None}


# ---- the figure ----------------------------------------------------------------------------------

def plot(results: Mapping, path: Path) -> Path | None:
    """Three panels: TTFT of turns >= 2 (p50, p99) per configuration; TTFT p50 by turn index; goodput with
    the share of prompt tokens of turns >= 2 served from cache."""
    plt = plots._pyplot()
    summaries = results["summaries"]
    if plt is None or not summaries:
        return None
    names = list(summaries)
    xs = range(len(names))
    fig, (ax_t2, ax_turn, ax_good) = plt.subplots(1, 3, figsize=(16, 5))
    p50 = [summaries[n]["ttft_turns_2_plus_ms"]["p50"] or 0 for n in names]
    p99 = [summaries[n]["ttft_turns_2_plus_ms"]["p99"] or 0 for n in names]
    ax_t2.bar([x - 0.2 for x in xs], p50, 0.4, label="p50")
    ax_t2.bar([x + 0.2 for x in xs], p99, 0.4, label="p99")
    ax_t2.set(ylabel="TTFT (ms)", title="TTFT of turns >= 2")
    for i, n in enumerate(names):
        by_turn = summaries[n]["ttft_p50_by_turn_ms"]
        turns = sorted(by_turn, key=int)
        ax_turn.plot([int(k) for k in turns], [by_turn[k] for k in turns], "o-", color=f"C{i}", label=n)
    ax_turn.set_xticks(sorted({int(k) for n in names for k in summaries[n]["ttft_p50_by_turn_ms"]}))
    ax_turn.set(xlabel="turn", ylabel="TTFT p50 (ms)", title="TTFT p50 by turn index")
    ax_turn.set_yscale("log")
    good = [summaries[n]["goodput"] for n in names]
    bars = ax_good.bar(list(xs), good)
    for bar, n in zip(bars, names, strict=True):
        share = summaries[n]["cached_prompt_share_turns_2_plus"]
        ax_good.annotate("-" if share is None else f"{share:.0%} cached", (bar.get_x() + bar.get_width() / 2,
                         bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax_good.set(ylabel="requests/s", title=f"goodput [{results['slo']}]\n(label: prompt tokens of turns >= 2 cached)")
    for ax in (ax_t2, ax_good):
        ax.set_xticks(list(xs), names)
    for ax in (ax_t2, ax_turn, ax_good):
        ax.grid(True, which="both", alpha=0.3)
    ax_t2.legend(fontsize=8)
    ax_turn.legend(fontsize=8)
    b = results["kv_budget"]
    fig.suptitle(f"multi-turn, L1 {b['l1_tokens']} tokens, working set {b['working_set_tokens']} tokens "
                 f"({b['working_set_over_l1']:.1f}x L1), {results['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
