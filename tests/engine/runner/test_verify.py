"""verify(): greedy acceptance is exact; sampled acceptance leaves each token's distribution unchanged."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.runner.sampler import Sampler, SamplingBatch, sampling_probs
from tandem.engine.runner.verify import VerifyRow, verify
from tandem.engine.sampling_params import SamplingParams

V = 8
N = 8000


def _logits(seed: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 1.5


def _freq(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=V).float() / max(1, len(tokens))


def test_greedy_accepts_the_matching_prefix_and_appends_the_target_token():
    logits = _logits(0, 4)
    target = logits.argmax(-1).tolist()
    g = SamplingParams(max_tokens=8, temperature=0.0)
    wrong = (target[1] + 1) % V
    out = verify(logits, [VerifyRow(g, [target[0], wrong, 3], None)], V)
    assert [t.token_id for t in out[0]] == [target[0], target[1]]
    out = verify(logits, [VerifyRow(g, target[:3], None)], V)
    assert [t.token_id for t in out[0]] == target           # all accepted + the bonus token


def _sample_many(params: SamplingParams, drafts: list[int], logits: torch.Tensor, seed: int):
    torch.manual_seed(seed)
    rows = [VerifyRow(params, drafts, None) for _ in range(N)]
    return verify(logits.repeat(N, 1), rows, V)


def test_sampled_tokens_follow_the_plain_sampling_distribution():
    logits = _logits(1, 2)
    for params in (SamplingParams(max_tokens=8, temperature=0.9),
                   SamplingParams(max_tokens=8, temperature=1.3, top_k=5, top_p=0.9)):
        sb = SamplingBatch.build([params] * 2, [[]] * 2, [[]] * 2, [None] * 2, V, "cpu")
        p = sampling_probs(logits, sb)
        for draft in (int(p[0].argmax()), int(p[0].argmin()), int(p[0].argsort()[V // 2])):
            out = _sample_many(params, [draft], logits, seed=draft)
            first = _freq([o[0].token_id for o in out])
            assert (first - p[0]).abs().max() < 0.025, (draft, first, p[0])
            accepted = [o for o in out if len(o) == 2]
            assert abs(len(accepted) / N - float(p[0, draft])) < 0.025
            if len(accepted) > 1000:   # the bonus token after an accepted draft follows row 1's distribution
                assert (_freq([o[1].token_id for o in accepted]) - p[1]).abs().max() < 0.05


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=8, temperature=1.0, seed=5),
                                    SamplingParams(max_tokens=8, temperature=0.8, top_k=4, seed=5),
                                    SamplingParams(max_tokens=8, temperature=1.1, top_p=0.8, min_p=0.05, seed=5)],
                         ids=["plain", "top-k", "top-p-min-p"])
def test_seeded_rows_pick_what_plain_sampling_picks_with_one_draw_per_token(params):
    logits = _logits(2, 3)
    gen = torch.Generator().manual_seed(5)
    plain = []
    for j in range(3):
        sb = SamplingBatch.build([params], [[]], [[]], [gen], V, "cpu")
        plain.append(int(Sampler()(logits[j:j + 1], sb).token_ids[0]))
    after_plain = gen.get_state()

    gen = torch.Generator().manual_seed(5)
    out = verify(logits, [VerifyRow(params, plain[:2], gen)], V)[0]
    assert [t.token_id for t in out] == plain and torch.equal(gen.get_state(), after_plain)

    gen = torch.Generator().manual_seed(5)
    wrong = (plain[1] + 1) % V
    out = verify(logits, [VerifyRow(params, [plain[0], wrong], gen)], V)[0]
    assert [t.token_id for t in out] == plain[:2]      # the rejection emits what plain sampling drew
    ref = torch.Generator().manual_seed(5)
    torch.empty(2).uniform_(generator=ref)
    assert torch.equal(gen.get_state(), ref.get_state())


def test_logprobs_come_from_the_raw_logits_at_each_position():
    logits = _logits(3, 3)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=2)
    target = logits.argmax(-1).tolist()
    out = verify(logits, [VerifyRow(params, target[:2], None)], V)[0]
    lps = torch.log_softmax(logits, -1)
    assert [t.token_id for t in out] == target
    for i, t in enumerate(out):
        assert abs(t.logprob - float(lps[i, target[i]])) < 1e-5
        assert [tid for tid, _ in t.top] == lps[i].topk(2).indices.tolist()
