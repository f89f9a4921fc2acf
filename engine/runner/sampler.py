"""Batched next-token sampling for one model step.

`SamplingBatch.build` turns the step's per-request `SamplingParams` into a few per-row tensors once;
`Sampler()(logits, batch)` then picks one token per row. Order of operations on each row:

  raw logits (fp32) -> repetition penalty (prompt + output tokens, HF-style)
                    -> frequency / presence penalties (output tokens, OpenAI-style)
                    -> greedy rows: arg-max
                    -> sampled rows: / temperature -> top-k -> top-p -> min-p -> draw

Logprobs are always taken from log_softmax of the RAW logits, i.e. the model's own distribution
before penalties and temperature, so they do not depend on the sampling settings. A grammar
(structured output) masks the tokens it forbids right after the penalties, before the greedy pick
and before temperature and the filters (which then act on the allowed tokens); logprobs stay the
model's own, unconstrained distribution like the other settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.engine.sampling_params import SamplingParams

# Temperatures below this are clamped to it: dividing logits by ~0 overflows fp32 and softmax
# then yields NaN, while 1e-5 already makes the draw effectively greedy.
_MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingBatch:
    """Per-step sampling metadata for B rows; build with `SamplingBatch.build`.

    Tensors are None when no row needs them, so an all-greedy batch without penalties or
    logprobs holds no tensors at all.
    """

    size: int
    vocab_size: int
    all_greedy: bool
    need_logprobs: bool
    max_top_logprobs: int
    greedy_mask: torch.Tensor | None  # [B] bool, only in mixed greedy/sampled batches
    temperatures: torch.Tensor | None  # [B, 1] fp32; greedy rows hold 1.0
    top_k: torch.Tensor | None  # [B, 1] int64; disabled rows hold vocab_size
    # Set when every sampled row has a top-k: candidates are then the top max_top_k, no full sort.
    max_top_k: int | None
    top_p: torch.Tensor | None  # [B, 1] fp32; disabled rows hold 2.0
    min_p: torch.Tensor | None  # [B, 1] fp32
    # Repetition penalty: factor per row and the ids seen in prompt + output, padded by repeating
    # an id already in the row (the factor is idempotent per id, so duplicates are harmless).
    repetition_penalties: torch.Tensor | None  # [B, 1] fp32; rows without penalty hold 1.0
    repetition_ids: torch.Tensor | None  # [B, L] int64
    # Frequency + presence penalties as one scatter-add: each output occurrence adds
    # -frequency_penalty, each distinct output id adds -presence_penalty, padding adds 0.
    penalty_ids: torch.Tensor | None  # [B, M] int64
    penalty_amounts: torch.Tensor | None  # [B, M] fp32
    seeded_rows: tuple[tuple[int, torch.Generator], ...]  # sampled rows drawing from their own generator
    # Structured output: [B, V] float32 added to the logits, 0 where each row's grammar allows the
    # token and -inf where it does not (None: no row constrained). Set by the runner once the step's
    # masks are computed (engine/runner/grammar_mask.py).
    grammar_bias: torch.Tensor | None = None

    @property
    def any_penalties(self) -> bool:
        return self.repetition_ids is not None or self.penalty_ids is not None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatch:
        """Gather the step's rows. All sequences are indexed by row.

        `prompt_ids` / `output_ids` are only read for rows with penalties. A row's generator (for
        requests with a seed) must live on `device`. Token ids must be < vocab_size, which must
        equal the logits' last dimension. Cost is O(B) Python work when no row has penalties and
        O(B + penalized tokens) otherwise; an all-greedy batch without penalties creates no tensor.
        """
        n = len(params)
        assert len(prompt_ids) == len(output_ids) == len(generators) == n
        greedy = [p.is_greedy for p in params]
        all_greedy = all(greedy)
        need_logprobs = any(p.wants_logprobs for p in params)
        max_top = max((p.top_logprobs for p in params), default=0)

        greedy_mask = temperatures = top_k = top_p = min_p = max_top_k = None
        seeded: list[tuple[int, torch.Generator]] = []
        if not all_greedy:
            sampled = [p for p, g in zip(params, greedy, strict=True) if not g]
            temps = [
                1.0 if g else max(p.temperature, _MIN_TEMPERATURE)
                for p, g in zip(params, greedy, strict=True)
            ]
            temperatures = _column(temps, torch.float32, device)
            if any(greedy):
                greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)
            if any(p.top_k > 0 for p in sampled):
                top_k = _column([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64, device)
                if all(p.top_k > 0 for p in sampled):
                    max_top_k = min(max(p.top_k for p in sampled), vocab_size)
            if any(p.top_p < 1.0 for p in sampled):
                # Rows without top-p get a threshold the cumulative mass never reaches, so fp32
                # rounding in the cumsum cannot clip their tail.
                top_p = _column([p.top_p if p.top_p < 1.0 else 2.0 for p in params], torch.float32, device)
            if any(p.min_p > 0.0 for p in sampled):
                min_p = _column([p.min_p for p in params], torch.float32, device)
            seeded = [(i, gen) for i, gen in enumerate(generators) if gen is not None and not greedy[i]]

        rep = rep_ids = pen_ids = pen_amounts = None
        if any(p.repetition_penalty != 1.0 for p in params):
            rows = [
                [*prompt, *out] if p.repetition_penalty != 1.0 else []
                for p, prompt, out in zip(params, prompt_ids, output_ids, strict=True)
            ]
            # A row with nothing seen pads with id 0, so it must not scale it.
            rep = _column(
                [p.repetition_penalty if r else 1.0 for p, r in zip(params, rows, strict=True)],
                torch.float32,
                device,
            )
            width = max(len(r) for r in rows)
            rep_ids = _ids(
                [r + [r[0] if r else 0] * (width - len(r)) for r in rows], width, vocab_size, device
            )
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            ids_rows: list[list[int]] = []
            amount_rows: list[list[float]] = []
            for p, out in zip(params, output_ids, strict=True):
                ids, amounts = [], []
                if p.frequency_penalty != 0.0:
                    ids += out
                    amounts += [-p.frequency_penalty] * len(out)
                if p.presence_penalty != 0.0:
                    distinct = list(set(out))
                    ids += distinct
                    amounts += [-p.presence_penalty] * len(distinct)
                ids_rows.append(ids)
                amount_rows.append(amounts)
            width = max(len(r) for r in ids_rows)
            pen_ids = _ids([r + [0] * (width - len(r)) for r in ids_rows], width, vocab_size, device)
            pen_amounts = torch.tensor(
                [r + [0.0] * (width - len(r)) for r in amount_rows], dtype=torch.float32, device=device
            ).reshape(n, width)

        return cls(
            size=n,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            need_logprobs=need_logprobs,
            max_top_logprobs=max_top,
            greedy_mask=greedy_mask,
            temperatures=temperatures,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalties=rep,
            repetition_ids=rep_ids,
            penalty_ids=pen_ids,
            penalty_amounts=pen_amounts,
            seeded_rows=tuple(seeded),
        )


@dataclass
class SampleOutput:
    """One step's picks.

    token_ids: [B] int64. logprobs: [B] fp32, the chosen token's log-probability under the raw
    logits (before penalties/temperature), or None when no row asked for logprobs.
    top_ids / top_logprobs: [B, k] with k = the batch's largest `top_logprobs`, sorted by
    descending logprob (raw logits as well); None when k == 0. Rows that asked for fewer take a
    prefix.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


class Sampler:
    """Picks one token per row of a [B, V] logits tensor. Stateless; never modifies `logits`."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        assert logits.dim() == 2 and logits.shape[0] == batch.size, (tuple(logits.shape), batch.size)
        raw = logits.float()
        x = _apply_penalties(raw, batch)

        if batch.all_greedy:
            token_ids = x.argmax(dim=-1)
        else:
            token_ids = _sample(x, batch)
            if batch.greedy_mask is not None:
                token_ids = torch.where(batch.greedy_mask, x.argmax(dim=-1), token_ids)

        out = SampleOutput(token_ids=token_ids)
        if batch.need_logprobs:
            logprobs = torch.log_softmax(raw, dim=-1)
            out.logprobs = logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
            if batch.max_top_logprobs > 0:
                out.top_logprobs, out.top_ids = logprobs.topk(batch.max_top_logprobs, dim=-1)
        return out


def _column(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)


def _ids(rows: list[list[int]], width: int, vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[B, width] int64 from rows of that length (width may be 0)."""
    # An out-of-range id would be a device-side assert on GPU; fail here with a message instead.
    assert max((max(r) for r in rows if r), default=0) < vocab_size, "token id outside the vocabulary"
    return torch.tensor(rows, dtype=torch.int64, device=device).reshape(len(rows), width)


def _apply_penalties(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Return penalized logits with the grammar's forbidden tokens at -inf; a copy, so the raw
    logits stay intact for logprobs.

    Penalties touch only the penalized ids (gather / scatter), not all B x V logits.
    """
    if batch.grammar_bias is not None:
        x = x + batch.grammar_bias   # a new tensor: the raw logits stay intact
    if not batch.any_penalties:
        return x
    x = x.clone()
    if batch.repetition_ids is not None:
        p = batch.repetition_penalties
        seen = x.gather(1, batch.repetition_ids)
        # HF semantics: shrink positive logits, push negative ones further down.
        x.scatter_(1, batch.repetition_ids, torch.where(seen > 0, seen / p, seen * p))
    if batch.penalty_ids is not None:
        x.scatter_add_(1, batch.penalty_ids, batch.penalty_amounts)
    return x


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] fp32: the distribution each sampled row draws from (penalties, temperature, top-k,
    top-p and min-p applied; each row sums to 1). Speculative verification accepts drafts by it."""
    probs, order = filtered_probs(logits, batch)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    if order is None:
        return probs
    return torch.zeros(probs.shape[0], batch.vocab_size, device=probs.device).scatter_(1, order, probs)


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a sampled row draws from: probabilities after penalties, temperature and the top-k /
    top-p / min-p filters (not renormalised after min-p), and the candidates' token ids when the
    columns are in each row's descending order (else None: vocabulary order)."""
    return _filtered_probs(_apply_penalties(logits.float(), batch), batch)


def _filtered_probs(x: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    order = None
    if batch.top_k is not None or batch.top_p is not None:
        # Work in each row's descending order: top-k is then a rank cut and top-p a prefix of the
        # cumulative mass. The draw happens in that order too and is mapped back at the end.
        # When every row has a top-k, the top max_top_k candidates suffice (a full sort of the
        # vocabulary is the most expensive op here on CPU).
        if batch.max_top_k is not None:
            x, order = x.topk(batch.max_top_k, dim=-1)
        else:
            x, order = x.sort(dim=-1, descending=True)
        # Temperature keeps the order, so it can scale the (possibly fewer) candidates.
        x = x / batch.temperatures
        if batch.top_k is not None:
            ranks = torch.arange(x.shape[-1], device=x.device)
            x = x.masked_fill(ranks >= batch.top_k, float("-inf"))
        if batch.top_p is not None:
            probs = torch.softmax(x, dim=-1)
            # Drop a token once the mass before it reaches top_p; the top token is always kept.
            mass_before = probs.cumsum(dim=-1) - probs
            x = x.masked_fill(mass_before >= batch.top_p, float("-inf"))
    else:
        x = x / batch.temperatures
    probs = torch.softmax(x, dim=-1)
    if batch.min_p is not None:
        # Relative to the row's largest probability; renormalizing does not change these ratios.
        probs = probs * (probs >= probs.amax(dim=-1, keepdim=True) * batch.min_p)
    return probs, order


def _sample(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Draw one token per row from the temperature-scaled, filtered distribution."""
    probs, order = _filtered_probs(x, batch)
    # Inverse-CDF draw: one uniform number per row, so a seeded row consumes exactly one draw of
    # its own generator per step whatever else is in the batch (and the batch needs no [B, V]
    # random tensor).
    u = torch.rand(batch.size, 1, device=x.device)
    for row, gen in batch.seeded_rows:
        u[row].uniform_(generator=gen)
    return inverse_cdf(probs.cumsum(dim=-1), order, u)


def inverse_cdf(cdf: torch.Tensor, order: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """[R] tokens for uniforms `u` [R, 1] under rows of cumulative mass `cdf` [R, C] (columns in
    `order`'s token ids, or vocabulary order). Speculative verification draws through this too, so
    that a seeded row picks the very token the plain sampler would with the same uniform."""
    # The kept mass may not sum to 1 (min-p, fp32 rounding): scale u by it. u < total strictly, so
    # the first cdf entry above u belongs to a token with nonzero mass.
    total = cdf[:, -1:]
    u = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    token = torch.searchsorted(cdf, u, right=True)
    if order is not None:
        token = order.gather(-1, token)
    return token.squeeze(-1)
