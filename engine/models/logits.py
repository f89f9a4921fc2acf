"""The vocabulary projection, with fp32 scores where a greedy choice depends on them.

A bf16 matmul rounds its output to bf16: at |logit| in [16, 32) neighbours are 0.125 apart, so two
candidates whose fp32 scores differ by less than that come out exactly equal, and `argmax` then
picks the lower token id, not the better token. SmolLM2's answer to "What is the capital of
France?" hinges on such a pair (" The" 25.33 vs "L" 25.24 in fp32; both 25.5 in bf16).

A full fp32 projection costs 2-4x the bf16 one on CPU (the tied embedding is a fifth of the
model's weights). Instead the bf16 scores pick the `RESCORE_TOP_K` best candidates of each row
and those are recomputed exactly (fp32 hidden state . fp32 weight row) and written back. The
greedy token, the reported logprobs of the top tokens and top-p/top-k cut-offs then come from
fp32 scores; the tail of the distribution keeps bf16 precision, which sampling cannot tell apart.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# The true argmax is among the bf16 top-k unless more than k-1 tokens round above it: with an
# output error of at most one bf16 ulp that needs k tokens inside a 0.25-wide band at the top.
RESCORE_TOP_K = 16


def compute_logits(hidden: torch.Tensor, weight: torch.Tensor | None,
                   projection: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """fp32 logits `[S, vocab]` for normalised hidden states `hidden` `[S, d]` (any float dtype).
    `projection`, if given, computes `hidden · weightᵀ` in the weight's dtype (a packed copy of it);
    `weight` None: the projection is fp32 and the only copy."""
    if weight is None or weight.dtype == torch.float32:
        return F.linear(hidden.float(), weight) if projection is None else projection(hidden.float())
    h = hidden.to(weight.dtype)
    logits = (F.linear(h, weight) if projection is None else projection(h)).float()
    if logits.shape[0] == 0:
        return logits
    k = min(RESCORE_TOP_K, logits.shape[1])
    top = logits.topk(k, dim=-1).indices                                   # [S, k]
    rows = weight.index_select(0, top.reshape(-1)).view(*top.shape, -1)    # [S, k, d]
    exact = torch.bmm(rows.float(), hidden.float().unsqueeze(-1)).squeeze(-1)
    return logits.scatter_(1, top, exact)
