"""Verification of draft tokens against the target model's logits (one forward for the whole batch).

A speculative row ran its last token plus k drafts, so it has k + 1 logits rows: row j is the
target's distribution after drafts 1..j. Its output is the accepted drafts plus one token of the
target's own (the correction at the first rejection, or the bonus token after k acceptances), so
every verified row emits between 1 and k + 1 tokens.

- Greedy rows accept a draft while it equals the target's arg-max; the output is then exactly what
  plain greedy decoding gives.
- Sampled rows use the rejection rule for a point-mass draft (both proposers here are
  deterministic): draft d is accepted with probability p(d), where p is the distribution the plain
  sampler would draw from (temperature, top-k, top-p, min-p applied); on rejection the token is
  drawn from p with d removed and renormalised, and after k acceptances the bonus token from p.
  Each emitted token is then distributed exactly as plain sampling's. A row draws k + 1 uniforms
  per step from its generator (its own when seeded), in a fixed order, so seeded runs repeat.

Penalties (repetition/frequency/presence) depend on the tokens before each position; rows with
them are not speculated (the speculator gives them no drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampler import SamplingBatch, sampling_probs
from engine.sampling_params import SamplingParams
from engine.scheduler.batch import SampledToken


@dataclass
class VerifyRow:
    params: SamplingParams
    drafts: list[int]
    generator: torch.Generator | None


def verify(logits: torch.Tensor, rows: list[VerifyRow], vocab_size: int) -> list[list[SampledToken]]:
    """`logits`: [sum(len(drafts) + 1), V], the rows of each VerifyRow in order."""
    device = logits.device
    spans, start = [], 0
    for r in rows:
        spans.append((start, len(r.drafts)))
        start += len(r.drafts) + 1
    assert start == logits.shape[0], (start, tuple(logits.shape))
    params = [r.params for r in rows for _ in range(len(r.drafts) + 1)]
    sb = SamplingBatch.build(params, [[]] * len(params), [[]] * len(params), [None] * len(params),
                             vocab_size, device)
    raw = logits.float()
    greedy_ids = raw.argmax(dim=-1).tolist()
    probs = None if sb.all_greedy else sampling_probs(raw, sb)
    p_draft = None
    if probs is not None:
        # p_j(d_{j+1}) for every draft of every row, in one gather.
        idx = [(s + j, d) for (s, _), r in zip(spans, rows, strict=True) for j, d in enumerate(r.drafts)]
        if idx:
            ri = torch.tensor([i for i, _ in idx], device=device)
            di = torch.tensor([d for _, d in idx], device=device)
            p_draft = iter(probs[ri, di].tolist())
    out: list[list[int]] = []
    for (s, k), r in zip(spans, rows, strict=True):
        if r.params.is_greedy:
            if p_draft is not None:
                for _ in range(k):
                    next(p_draft)
            m = 0
            while m < k and r.drafts[m] == greedy_ids[s + m]:
                m += 1
            out.append(r.drafts[:m] + [greedy_ids[s + m]])
            continue
        u = torch.rand(k + 1, generator=r.generator, device=device) if r.generator is not None \
            else torch.rand(k + 1, device=device)
        u = u.tolist()
        pd = [next(p_draft) for _ in range(k)]
        m = 0
        while m < k and u[m] < pd[m]:
            m += 1
        q = probs[s + m]
        if m < k:                                   # rejected: draw from p without the draft
            q = q.clone()
            q[r.drafts[m]] = 0.0
        out.append(r.drafts[:m] + [_draw(q, u[k])])
    return _with_logprobs(raw, rows, spans, out)


def _draw(q: torch.Tensor, u: float) -> int:
    cdf = q.cumsum(dim=0)
    total = float(cdf[-1])
    if total <= 0.0:            # rounding left no mass beside the rejected draft
        return int(q.argmax())
    x = min(u * total, torch.nextafter(torch.tensor(total), torch.tensor(0.0)).item())
    return int(torch.searchsorted(cdf, torch.tensor([x], device=q.device), right=True)[0])


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
