"""Verification of draft tokens against the target model's logits (one forward for the whole batch).

A speculative row ran its last token plus k drafts, so it has k + 1 logits rows: row j is the
target's distribution after drafts 1..j. Its output is the accepted drafts plus one token of the
target's own (the correction at the first rejection, or the bonus token after k acceptances), so
every verified row emits between 1 and k + 1 tokens.

- Greedy rows accept a draft while it equals the target's arg-max; the output is then exactly what
  plain greedy decoding gives.
- Sampled rows use the rejection rule for a point-mass draft (both proposers here are
  deterministic): draft d is accepted with probability p(d), where p is the distribution the plain
  sampler draws from (temperature, top-k, top-p, min-p applied), and on rejection the token comes
  from p with d removed and renormalised. It is implemented as the coupling that makes this exact
  and cheap: draw the token t = F^-1(u) the plain sampler would draw at that position with the next
  uniform u, accept d iff t == d, else emit t (which then is distributed as p without d). Each
  emitted token consumes exactly one uniform of the row's generator, the same one plain decoding
  would consume for it, so a seeded request gives the same tokens with and without speculation
  (up to floating-point differences between the verify and decode forward paths).

Penalties (repetition/frequency/presence) depend on the tokens before each position; rows with
them are not speculated (the speculator gives them no drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.runner.sampler import SamplingBatch, filtered_probs, inverse_cdf
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.batch import SampledToken


@dataclass
class VerifyRow:
    params: SamplingParams
    drafts: list[int]
    generator: torch.Generator | None


def verify(logits: torch.Tensor, rows: list[VerifyRow], vocab_size: int,
           grammar_bias: torch.Tensor | None = None) -> list[list[SampledToken]]:
    """`logits`: [sum(len(drafts) + 1), V], the rows of each VerifyRow in order. `grammar_bias`:
    the grammar's mask of each of those rows ([rows, V] float32, 0 allowed / -inf forbidden;
    structured output), None: unconstrained.
    Drafts were cut where the grammar refused them, and the masks of a row's positions assume the
    drafts before them, so every emitted token is one the grammar allows."""
    device = logits.device
    spans, start = [], 0
    for r in rows:
        spans.append((start, len(r.drafts)))
        start += len(r.drafts) + 1
    assert start == logits.shape[0], (start, tuple(logits.shape))
    params = [r.params for r in rows for _ in range(len(r.drafts) + 1)]
    sb = SamplingBatch.build(params, [[]] * len(params), [[]] * len(params), [None] * len(params),
                             vocab_size, device)
    sb.grammar_bias = grammar_bias
    raw = logits.float()
    picked = raw if grammar_bias is None else raw + grammar_bias
    greedy_ids = picked.argmax(dim=-1).tolist()
    cdf = order = None
    if not sb.all_greedy:
        probs, order = filtered_probs(raw, sb)
        cdf = probs.cumsum(dim=-1)
    out: list[list[int]] = []
    for (s, k), r in zip(spans, rows, strict=True):
        toks: list[int] = []
        for j in range(k + 1):
            if r.params.is_greedy:
                t = greedy_ids[s + j]
            else:
                u = torch.empty(1, 1, device=device)
                u.uniform_(generator=r.generator) if r.generator is not None else u.uniform_()
                row = slice(s + j, s + j + 1)
                t = int(inverse_cdf(cdf[row], order[row] if order is not None else None, u)[0])
            toks.append(t)
            if j == k or t != r.drafts[j]:
                break
        out.append(toks)
    return _with_logprobs(raw, rows, spans, out)


def _with_logprobs(raw: torch.Tensor, rows: list[VerifyRow], spans: list[tuple[int, int]],
                   tokens: list[list[int]]) -> list[list[SampledToken]]:
    """Logprobs of the emitted tokens under the raw logits, as the plain sampler reports them."""
    if not any(r.params.wants_logprobs for r in rows):
        return [[SampledToken(t) for t in toks] for toks in tokens]
    result = []
    for (s, _), r, toks in zip(spans, rows, tokens, strict=True):
        if not r.params.wants_logprobs:
            result.append([SampledToken(t) for t in toks])
            continue
        lps = torch.log_softmax(raw[s:s + len(toks)], dim=-1)
        chosen = lps.gather(1, torch.tensor(toks, device=raw.device).unsqueeze(1)).squeeze(1).tolist()
        k = r.params.top_logprobs
        top = None
        if k:
            vals, ids = lps.topk(k, dim=-1)
            top = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]
        result.append([SampledToken(t, chosen[i] if r.params.logprobs else None, top[i] if top else None)
                       for i, t in enumerate(toks)])
    return result
