import pytest
import torch

from tandem.engine.runner.sampler import Sampler, SamplingBatch, _apply_penalties
from tandem.engine.sampling_params import SamplingParams

V = 32


def build(params, prompt=None, output=None, generators=None, vocab_size=V):
    n = len(params)
    return SamplingBatch.build(
        params,
        prompt if prompt is not None else [[]] * n,
        output if output is not None else [[]] * n,
        generators if generators is not None else [None] * n,
        vocab_size,
        "cpu",
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = torch.randn(5, V, generator=seeded(0)).to(dtype)
    out = Sampler()(logits, build([SamplingParams(temperature=0.0)] * 5))
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.float().argmax(-1))
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None


def test_all_greedy_batch_builds_no_tensors():
    batch = build([SamplingParams(temperature=0.0)] * 32)
    assert batch.all_greedy and not batch.any_penalties and not batch.need_logprobs
    tensors = [v for v in vars(batch).values() if isinstance(v, torch.Tensor)]
    assert tensors == []


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    batch = build(
        [p, SamplingParams(temperature=0.0)],
        prompt=[[0], [0, 1]],
        output=[[1, 1, 3], [1, 3]],
        vocab_size=5,
    )
    # Row 0: repetition over {0, 1, 3}: 2/2, -1*2, 3/2; then output counts {1: 2, 3: 1}:
    # -2 - 0.5*2 - 0.25 and 1.5 - 0.5 - 0.25. Row 1 has no penalties and stays raw.
    expected = torch.tensor([[1.0, -3.25, 0.5, 0.75, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    assert torch.allclose(_apply_penalties(logits, batch), expected)
    out = Sampler()(logits, batch)
    assert out.token_ids.tolist() == [0, 3]


def test_frequency_penalty_counts_output_only():
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    batch = build(
        [SamplingParams(temperature=0.0, presence_penalty=0.5)], prompt=[[1]], output=[[0]], vocab_size=3
    )
    assert torch.allclose(_apply_penalties(logits, batch), torch.tensor([[0.5, 0.9, 0.0]]))


def test_sampler_does_not_modify_logits():
    logits = torch.randn(3, V, generator=seeded(1))
    before = logits.clone()
    p = SamplingParams(
        temperature=0.8, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.3, presence_penalty=1.0
    )
    Sampler()(logits, build([p] * 3, prompt=[[1, 2]] * 3, output=[[3]] * 3))
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1e-9),
        SamplingParams(temperature=1.0, min_p=1.0),
    ],
)
def test_degenerate_settings_pick_argmax(params):
    torch.manual_seed(0)
    logits = torch.randn(64, V, generator=seeded(2)) * 3
    out = Sampler()(logits, build([params] * 64))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_mixed_batch_greedy_rows_take_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, V, generator=seeded(3))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5)] * 3
    out = Sampler()(logits, build(params))
    assert torch.equal(out.token_ids[0::2], logits[0::2].argmax(-1))


# probs 0.5, 0.3, 0.15, 0.05
FILTER_LOGITS = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()


def sample_counts(params: SamplingParams, n: int = 4000) -> torch.Tensor:
    torch.manual_seed(1234)
    out = Sampler()(FILTER_LOGITS.expand(n, -1), build([params] * n, vocab_size=4))
    return torch.bincount(out.token_ids, minlength=4)


def test_min_p_filters_relative_to_top_prob():
    counts = sample_counts(SamplingParams(min_p=0.2))  # keeps p >= 0.1
    assert counts[3] == 0 and (counts[:3] > 0).all()


def test_top_k_filters():
    counts = sample_counts(SamplingParams(top_k=2))
    assert counts[2:].sum() == 0 and (counts[:2] > 0).all()


def test_top_p_filters():
    counts = sample_counts(SamplingParams(top_p=0.7))  # 0.5 + 0.3 reaches 0.7
    assert counts[2:].sum() == 0 and (counts[:2] > 0).all()
    counts = sample_counts(SamplingParams(top_p=0.81))
    assert counts[3] == 0 and (counts[:3] > 0).all()


def test_temperature_sampling_matches_softmax():
    torch.manual_seed(99)
    n, temperature = 8000, 0.7
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    out = Sampler()(logits.expand(n, -1), build([SamplingParams(temperature=temperature)] * n, vocab_size=6))
    freq = torch.bincount(out.token_ids, minlength=6).float() / n
    expected = torch.softmax(logits / temperature, -1)
    assert (freq - expected).abs().max() < 0.03, (freq, expected)


def test_filtered_sampling_renormalizes():
    counts = sample_counts(SamplingParams(top_k=3), n=8000).float()
    freq = counts / counts.sum()
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert (freq - expected).abs().max() < 0.03, freq


def test_seeded_row_does_not_depend_on_batch():
    logits = torch.randn(4, V, generator=seeded(4))
    p = SamplingParams(temperature=1.0, seed=7)

    def run_alone():
        gen = seeded(7)
        return [Sampler()(logits[2:3], build([p], generators=[gen])).token_ids.item() for _ in range(30)]

    def run_batched():
        gen = seeded(7)
        params = [SamplingParams(temperature=1.2), SamplingParams(temperature=0.0), p, SamplingParams(seed=8)]
        batch = build(params, generators=[None, seeded(0), gen, seeded(8)])
        return [Sampler()(logits, batch).token_ids[2].item() for _ in range(30)]

    alone = run_alone()
    assert alone == run_batched()
    assert len(set(alone)) > 1  # the row really is sampled, not argmax


def test_logprobs_come_from_raw_logits():
    torch.manual_seed(0)
    logits = torch.randn(4, V, generator=seeded(5))
    params = [
        SamplingParams(temperature=0.5, logprobs=True, repetition_penalty=1.5, frequency_penalty=1.0),
        SamplingParams(temperature=0.0, top_logprobs=5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.5, top_logprobs=2),
    ]
    out = Sampler()(logits, build(params, prompt=[[1, 2]] * 4, output=[[3, 3]] * 4))
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs, ref.gather(-1, out.token_ids[:, None]).squeeze(-1))
    assert out.top_ids.shape == out.top_logprobs.shape == (4, 5)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert torch.allclose(out.top_logprobs, ref.gather(-1, out.top_ids))
    assert torch.equal(out.top_ids[:, 0], logits.argmax(-1))


def test_logprobs_without_top_logprobs():
    logits = torch.randn(2, V, generator=seeded(6)).half()
    out = Sampler()(logits, build([SamplingParams(temperature=0.0, logprobs=True)] * 2))
    assert out.top_ids is None and out.top_logprobs is None
    assert torch.allclose(out.logprobs, torch.log_softmax(logits.float(), -1).amax(-1))


def test_penalties_with_empty_history():
    logits = torch.randn(2, V, generator=seeded(7))
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=1.0)
    batch = build([p, p])  # prefill: no output yet, and an empty prompt
    assert torch.equal(_apply_penalties(logits, batch), logits)


def test_repeated_output_tokens_accumulate_frequency_but_not_presence():
    logits = torch.zeros(1, 4)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    batch = build([p], output=[[2, 2, 2, 1]], vocab_size=4)
    assert torch.allclose(_apply_penalties(logits, batch), torch.tensor([[0.0, -1.5, -2.5, 0.0]]))


def test_top_p_distribution_on_full_sort_path():
    counts = sample_counts(SamplingParams(top_p=0.9), n=8000).float()
    freq = counts / counts.sum()
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert (freq - expected).abs().max() < 0.03, freq


def test_seeded_row_same_on_top_k_and_full_sort_paths():
    logits = torch.randn(2, V, generator=seeded(8))
    p = SamplingParams(temperature=1.0, top_k=8, seed=3)

    def run(other: SamplingParams):
        gen = seeded(3)
        batch = build([other, p], generators=[None, gen])
        return [Sampler()(logits, batch).token_ids[1].item() for _ in range(30)]

    # All rows with top-k (candidate path) vs one row without (full sort path).
    assert run(SamplingParams(top_k=20)) == run(SamplingParams(top_p=0.5))
    assert SamplingBatch.build([p, p], [[]] * 2, [[]] * 2, [None] * 2, V, "cpu").max_top_k == 8


def test_top_k_larger_than_vocab():
    torch.manual_seed(0)
    logits = torch.randn(3, V, generator=seeded(9))
    out = Sampler()(logits, build([SamplingParams(top_k=10 * V, top_p=0.999)] * 3))
    assert out.token_ids.shape == (3,) and (out.token_ids < V).all()
