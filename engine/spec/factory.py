"""Builds the speculator an EngineConfig asks for (None without --speculative-algorithm)."""

from __future__ import annotations

from tandem.engine.config import EngineConfig
from tandem.engine.kvcache.kv_manager import KVManager
from tandem.engine.spec.speculator import Speculator


def create_speculator(cfg: EngineConfig, kv: KVManager, context_len: int, model_cfg, runner) -> Speculator | None:
    algo = cfg.speculative_algorithm
    if algo is None:
        return None
    if algo == "ngram":
        from tandem.engine.spec.ngram import NgramDrafts

        proposer = NgramDrafts(cfg.speculative_ngram_min, cfg.speculative_ngram_max)
    else:
        from tandem.engine.spec.draft_model import DraftModelProposer

        proposer = DraftModelProposer(cfg, model_cfg, runner, context_len)
    return Speculator(proposer, cfg.speculative_num_draft_tokens, kv, context_len, cfg.speculative_adaptive)
