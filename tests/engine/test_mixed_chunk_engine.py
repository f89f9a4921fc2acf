"""Mixed steps give the same greedy tokens as plain steps (and as HF), through arrivals, prefix hits,
chunked prefill, retraction and aborts mid-batch."""

from __future__ import annotations

import pytest

from tests.engine.test_engine_vs_hf import greedy, hf_greedy, make_engine, random_prompts


def run_staggered(engine, prompts, n, abort_at=None):
    """Add a prompt every other step (so prompts arrive while others decode); abort request
    `abort_at` after its third step. Returns tokens per prompt and the number of mixed steps."""
    pending = list(enumerate(prompts))
    rids, tokens, mixed, steps = {}, {}, 0, 0
    while pending or engine.has_unfinished():
        if pending and steps % 2 == 0:
            i, p = pending.pop(0)
            rids[engine.add_request(p, greedy(n))] = i
        outs = engine.step()
        steps += 1
        batch = engine.runner.last_batch
        kinds = {len(s.input_ids) == 1 and s.prefix_len >= s.req.fill_len for s in batch.seqs} if batch else set()
        mixed += kinds == {True, False}
        for o in outs:
            tokens.setdefault(rids[o.rid], []).extend(o.token_ids)
        if abort_at is not None and steps == 6:
            victim = next(r for r, i in rids.items() if i == abort_at)
            engine.abort(victim)
    engine.check_idle()
    return tokens, mixed


@pytest.mark.parametrize("pool_tokens", [2048, 64], ids=["roomy", "tight-retracts"])
def test_mixed_equals_plain_and_hf(tiny_llama, pool_tokens):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    base = random_prompts([9, 30, 4, 21], 512, seed=11)
    prompts = base + [base[1][:24] + [7, 8, 9]]      # a prefix hit on prompt 1's pages
    kw = dict(chunked_prefill_size=8, max_total_tokens=pool_tokens)
    if pool_tokens < 100:   # optimistic admission into a tight pool: decode must retract
        kw.update(init_new_token_ratio=0.01, min_new_token_ratio=0.01)
    mixed_engine = make_engine(tiny_llama, enable_mixed_chunk=True, mixed_chunk_itl_factor=0, **kw)
    plain_engine = make_engine(tiny_llama, enable_mixed_chunk=False, **kw)
    mixed_tokens, mixed_steps = run_staggered(mixed_engine, prompts, 10)
    plain_tokens, plain_mixed = run_staggered(plain_engine, prompts, 10)
    assert mixed_steps > 0 and plain_mixed == 0
    assert mixed_tokens == plain_tokens
    for i, p in enumerate(prompts):
        assert mixed_tokens[i] == hf_greedy(hf, p, 10), i
    if pool_tokens == 64:
        assert mixed_engine.scheduler.num_retractions > 0


def test_abort_mid_batch_leaves_others_unchanged(tiny_llama):
    prompts = random_prompts([12, 5, 17], 512, seed=12)
    engine = make_engine(tiny_llama, chunked_prefill_size=8)
    alone, _ = run_staggered(make_engine(tiny_llama, chunked_prefill_size=8), prompts, 8)
    tokens, mixed = run_staggered(engine, prompts, 8, abort_at=1)
    assert mixed > 0
    assert tokens[0] == alone[0] and tokens[2] == alone[2]
    assert len(tokens.get(1, [])) < 8
