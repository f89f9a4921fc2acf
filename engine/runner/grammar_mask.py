"""A step's grammar masks: which tokens each constrained row may sample, computed on the CPU beside
the forward pass and applied to the logits before sampling.

`MaskJob.for_step` lists the step's constrained rows at prepare time; `fill` computes their masks
(llguidance releases the GIL, so it runs in parallel with the forward pass) and turns them into an
additive bias, and `wait` hands the sampler that [rows, vocab] float32 tensor (0 where a token is
allowed, -inf where not): adding it costs a fraction of a masked_fill on the sampler's critical path
(batch 32, 49k vocabulary: ~0.3 vs ~4 ms on this CPU), and the unpacking runs off it. Who runs `fill`, and when, is the engine's choice: without
overlap a helper thread right after prepare (every token the masks depend on is known); with
overlap the scheduling thread once the previous step's tokens have been consumed, while this
step's forward pass runs. A verify row (speculation) gets num_drafts + 1 masks: the matcher is
walked over the drafts and rolled back.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from tandem.engine.scheduler.batch import SeqStep
from tandem.engine.structured.matcher import bitmask_words, fill_rows

log = logging.getLogger(__name__)

@dataclass
class _Row:
    first: int          # its first logits row among the step's sampled rows
    seq: SeqStep


class MaskJob:
    def __init__(self, rows: list[_Row], num_rows: int, vocab_size: int):
        self.rows = rows
        self.vocab_size = vocab_size
        self.bitmask = np.full((num_rows, bitmask_words(vocab_size)), -1, dtype=np.int32)
        self.empty_rows: list[int] = []    # rows whose grammar left no token (dead end: all allowed)
        self._bias: np.ndarray | None = None
        self._done = threading.Event()
        self.fill_s = 0.0

    @staticmethod
    def for_step(sampling: list[SeqStep], vocab_size: int) -> MaskJob | None:
        """None when no sampled row of the step is constrained."""
        rows, n = [], 0
        for s in sampling:
            if s.req.grammar is not None:
                rows.append(_Row(n, s))
            n += s.num_drafts + 1
        return MaskJob(rows, n, vocab_size) if rows else None

    def fill(self) -> None:
        """Compute every constrained row's mask; never raises (a failure leaves the row unconstrained
        and is logged: the engine's token check then ends the request)."""
        t0 = time.perf_counter()
        try:
            live = [r for r in self.rows if not r.seq.req.finished]   # (overlap) ended meanwhile: dropped
            plain = [r for r in live if not r.seq.num_drafts]
            if plain:
                fill_rows([(r.seq.req.grammar, r.first) for r in plain], self.bitmask)
                for r in plain:
                    row = self.bitmask[r.first]
                    if r.seq.req.grammar.dead or not row.any():
                        row.fill(-1)
                        self.empty_rows.append(r.first)
            for r in live:
                if r.seq.num_drafts:
                    self._fill_verify_row(r)
        except Exception:
            log.exception("grammar mask computation failed")
        try:
            # Bit t of int32 word t // 32 is bit t % 8 of byte t // 8 (little-endian words).
            allowed = np.unpackbits(self.bitmask.view(np.uint8), axis=1, bitorder="little")[:, :self.vocab_size]
            self._bias = np.where(allowed, np.float32(0.0), np.float32(-np.inf))
        except Exception:
            log.exception("grammar mask computation failed")
        finally:
            self.fill_s = time.perf_counter() - t0
            self._done.set()

    def _fill_verify_row(self, r: _Row) -> None:
        g = r.seq.req.grammar
        drafts = r.seq.input_ids[len(r.seq.input_ids) - r.seq.num_drafts:]
        walked = 0
        for j in range(len(drafts) + 1):
            row = self.bitmask[r.first + j]
            if not g.fill(row):
                row.fill(-1)
                self.empty_rows.append(r.first + j)
            # Drafts were checked when proposed; a refused one would leave the rows after open.
            if j == len(drafts) or g.accepts(drafts[j:j + 1]) != 1:
                break
            g.consume(drafts[j:j + 1])
            walked += 1
        g.rollback(walked)

    def wait(self, device: torch.device) -> torch.Tensor | None:
        """[rows, vocab] float32 on `device`: 0 where the token is allowed, -inf where the grammar
        forbids it (None if the masks could not be computed: unconstrained, logged)."""
        self._done.wait()
        if self._bias is None:
            return None
        return torch.from_numpy(self._bias).to(device, non_blocking=True)
