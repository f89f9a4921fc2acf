"""Draft-model proposer: a small model of the same tokenizer proposes k tokens autoregressively.

It owns a second ModelRunner (its own weights and its own paged KV pool, sized like the target's
in tokens) and a KVManager over that pool (no prefix cache). Each request the speculator asks about
gets a shadow `Request` there whose `prompt_ids` are the tokens its draft KV was computed for.
One proposal round for a batch is

    1 extend step: every row catches up on the tokens its draft KV lacks (the whole prompt the first
      time: a decode worker's prompt KV came from the prefill worker for the target only), sampling d1;
    k - 1 decode steps: d2 .. dk, greedily.

Draft KV of accepted drafts stays valid (same tokens at the same positions); on the next round the
shadow keeps the longest common prefix of what it computed and the request's tokens and recomputes
the rest. Drafting is greedy (a point-mass proposal, which verify()'s rejection rule assumes).
A request whose shadow cannot get pages gets no drafts; shadows are freed when the request ends.
"""

from __future__ import annotations

import dataclasses
import logging

from tandem.engine.config import EngineConfig
from tandem.engine.errors import InvalidRequest
from tandem.engine.kvcache.kv_manager import KVManager
from tandem.engine.models.config import ModelConfig
from tandem.engine.models.source import resolve_model
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.batch import SeqStep, StepBatch
from tandem.engine.scheduler.request import Request

log = logging.getLogger(__name__)


class DraftModelProposer:
    def __init__(self, cfg: EngineConfig, target_cfg: ModelConfig, target_runner, context_len: int):
        # torch lives in the runner; imported only for this proposer
        from tandem.engine.runner.model_runner import ModelRunner

        path = resolve_model(cfg.speculative_draft_model)
        draft_cfg = ModelConfig.from_pretrained(path)
        if draft_cfg.vocab_size != target_cfg.vocab_size:
            raise InvalidRequest(
                f"draft model {path} has vocab_size {draft_cfg.vocab_size}, the target {target_cfg.vocab_size}: "
                "a draft model must share the target's tokenizer", "speculative_draft_model")
        if draft_cfg.max_position_embeddings < context_len:
            raise InvalidRequest(
                f"draft model {path} supports {draft_cfg.max_position_embeddings} positions, the target's context "
                f"is {context_len}: set --context-length", "speculative_draft_model")
        target_tokens = target_runner.num_pages * cfg.page_size
        # Its pool holds what the target's does plus the drafts in flight of every slot.
        tokens = target_tokens + cfg.max_running_requests * cfg.speculative_num_draft_tokens
        run_cfg = dataclasses.replace(cfg, model=str(path), speculative_algorithm=None, max_total_tokens=tokens,
                                      enable_prefix_cache=False)
        self.k = cfg.speculative_num_draft_tokens
        self.runner = ModelRunner(run_cfg, draft_cfg, context_len)
        self.kv = KVManager(self.runner.num_pages, cfg.page_size, cfg.max_running_requests, enable_prefix_cache=False)
        self._greedy = SamplingParams(max_tokens=context_len, temperature=0.0, ignore_eos=True)
        self.shadows: dict[str, Request] = {}

    def propose_batch(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        seqs: list[SeqStep] = []
        rows: list[int] = []
        for i, (req, k) in enumerate(zip(reqs, ks, strict=True)):
            seq = self._catch_up(req, k)
            if seq is not None:
                seqs.append(seq)
                rows.append(i)
        drafts: list[list[int]] = [[] for _ in reqs]
        if not seqs:
            return drafts
        step = StepBatch(seqs)
        for _ in range(max(ks[i] for i in rows)):
            toks = self.runner.run(step)
            nxt = []
            for seq, i, tok in zip(step.seqs, rows, toks, strict=True):
                drafts[i].append(tok.token_id)
                sh = seq.req
                sh.num_computed = seq.prefix_len + len(seq.input_ids)
                if len(drafts[i]) < ks[i]:
                    sh.prompt_ids.append(tok.token_id)
                    nxt.append((SeqStep(sh, [tok.token_id], sh.num_computed, True), i))
            if not nxt:
                break
            step = StepBatch([s for s, _ in nxt])
            rows = [i for _, i in nxt]
        return drafts

    def _catch_up(self, req: Request, k: int) -> SeqStep | None:
        """The extend step that brings `req`'s shadow to its current tokens, with room for k - 1
        drafts after them; None when the draft pool has no room."""
        ids = req.all_ids
        sh = self.shadows.get(req.rid)
        if sh is None:
            sh = Request(req.rid, [], self._greedy)
            if not self.kv.admit(sh, ids[:1]):
                return None
            sh.num_computed = 0
            self.shadows[req.rid] = sh
        have = sh.prompt_ids
        common = 0
        limit = min(sh.num_computed, len(ids))
        while common < limit and have[common] == ids[common]:
            common += 1
        if common == len(ids):      # everything computed: recompute the last token for its logits
            common -= 1
        if not self.kv.ensure_capacity(sh, len(ids) + k - 1):
            self.release(req.rid)
            return None
        sh.prompt_ids = list(ids)
        sh.num_computed = common
        return SeqStep(sh, ids[common:], common, True)

    def release(self, rid: str) -> None:
        sh = self.shadows.pop(rid, None)
        if sh is not None:
            self.kv.release(sh)
            self.runner.release(rid)

    def check_idle(self) -> None:
        assert not self.shadows, f"draft KV still held for {list(self.shadows)[:5]}"
        self.kv.check_idle()
