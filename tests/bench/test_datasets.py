"""Workloads: exact token counts, lengths in range, shared prefixes, ShareGPT parsing (torch-free)."""

import json
import random

import pytest
from tokenizers import Tokenizer

from tandem.bench.serve.datasets import DatasetConfig, TokenSampler, build_dataset, encode, load_tokenizer
from tests.bench.fakes import byte_level_bpe


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return byte_level_bpe()


def test_word_sampler_gives_exact_counts(tok):
    sampler = TokenSampler(tok)
    assert len(sampler.words) >= 100  # the whole-word path, not the fallback
    rng = random.Random(1)
    for n in (1, 2, 17, 256):
        text, ids = sampler.sample(n, rng)
        assert len(ids) == n and encode(tok, text) == ids


def test_fallback_trimming_gives_exact_counts(tok):
    sampler = TokenSampler(tok)
    rng = random.Random(2)
    for n in (1, 5, 64):
        text, ids = sampler._trimmed(n, rng)
        assert len(ids) == n and encode(tok, text) == ids


def test_random_dataset_lengths_in_range_and_deterministic(tok):
    cfg = DatasetConfig(name="random", num_prompts=50, input_len=100, output_len=20, range_ratio=0.25, seed=3)
    reqs = build_dataset(cfg, tok)
    assert len(reqs) == 50
    for r in reqs:
        assert 75 <= r.prompt_len <= 125 and 15 <= r.output_len <= 25
        assert len(encode(tok, r.prompt)) == r.prompt_len and list(r.prompt_ids) == encode(tok, r.prompt)
    assert len({r.prompt_len for r in reqs}) > 5
    assert build_dataset(cfg, tok) == reqs
    assert build_dataset(DatasetConfig(num_prompts=50, input_len=100, output_len=20, range_ratio=0.25, seed=4), tok) != reqs


def test_random_dataset_exact_lengths_without_range(tok):
    reqs = build_dataset(DatasetConfig(num_prompts=8, input_len=32, output_len=7), tok)
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(32, 7)}
    assert len({r.prompt_ids[:4] for r in reqs}) == 8  # prompts do not share prefixes


def test_shared_prefix_dataset(tok):
    cfg = DatasetConfig(name="shared-prefix", num_prompts=12, input_len=10, output_len=5, prefix_len=40,
                        num_prefix_groups=3)
    reqs = build_dataset(cfg, tok)
    assert all(r.prompt_len == 50 and len(encode(tok, r.prompt)) == 50 for r in reqs)
    groups = {r.prompt_ids[:40] for r in reqs}
    assert len(groups) == 3
    assert sorted(sum(r.prompt_ids[:40] == g for r in reqs) for g in groups) == [4, 4, 4]
    assert len({r.prompt_ids[40:] for r in reqs}) == 12


def test_sharegpt_dataset(tok, tmp_path):
    convs = [
        {"conversations": [{"from": "human", "value": "alpha bravo charlie delta echo"},
                           {"from": "gpt", "value": "red green blue cyan magenta yellow"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "too short prompt"}]},
        {"conversations": [{"from": "human", "value": "only one turn here and nothing more"}]},
        {"messages": [{"role": "user", "content": "river mountain forest desert ocean"},
                      {"role": "assistant", "content": "island valley canyon meadow glacier volcano harbor"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    reqs = build_dataset(DatasetConfig(name="sharegpt", path=str(path), num_prompts=2, output_len=None), tok)
    assert sorted(r.prompt for r in reqs) == ["alpha bravo charlie delta echo", "river mountain forest desert ocean"]
    for r in reqs:
        assert r.prompt_ids is None and r.prompt_len == len(encode(tok, r.prompt)) and r.output_len >= 4
    fixed = build_dataset(DatasetConfig(name="sharegpt", path=str(path), num_prompts=5, output_len=9), tok)
    assert len(fixed) == 5 and {r.output_len for r in fixed} == {9}  # repeated to fill, output overridden


def test_dataset_errors(tok, tmp_path):
    with pytest.raises(ValueError, match="dataset-path"):
        build_dataset(DatasetConfig(name="sharegpt"), tok)
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ValueError, match="no usable"):
        build_dataset(DatasetConfig(name="sharegpt", path=str(tmp_path / "empty.json")), tok)
    with pytest.raises(ValueError, match="unknown dataset"):
        build_dataset(DatasetConfig(name="nope"), tok)
    with pytest.raises(ValueError, match="range ratio"):
        build_dataset(DatasetConfig(range_ratio=1.5), tok)


def test_load_tokenizer_from_file_and_folder(tok, tmp_path):
    tok.save(str(tmp_path / "tokenizer.json"))
    for where in (tmp_path, tmp_path / "tokenizer.json"):
        assert load_tokenizer(str(where)).get_vocab_size() == tok.get_vocab_size()


def test_priority_mix_parses_weights_into_shares():
    from tandem.bench.serve.datasets import parse_priority_mix

    assert parse_priority_mix("10:1,0:3") == ((10, 0.25), (0, 0.75))
    assert parse_priority_mix(" -5:2 ") == ((-5, 1.0),)
    assert parse_priority_mix("") == ()
    for bad in ("10", "x:1", "10:0", "10:-1", "10:nan", "1:1,1:2", "1.5:1"):
        with pytest.raises(ValueError, match="priority"):
            parse_priority_mix(bad)


def test_priority_mix_exact_counts_shuffled_and_deterministic(tok):
    from tandem.bench.serve.datasets import parse_priority_mix

    cfg = DatasetConfig(name="random", num_prompts=10, input_len=8, output_len=2, seed=4,
                        priority_mix=parse_priority_mix("10:1,0:2"))
    reqs = build_dataset(cfg, tok)
    prios = [r.priority for r in reqs]
    assert sorted(prios).count(10) == 3 and prios.count(0) == 7   # 10/3 = 3.33 and 6.67 -> 3 and 7
    assert prios != sorted(prios, reverse=True)                   # interleaved, not the high class first
    assert [r.priority for r in build_dataset(cfg, tok)] == prios
    plain = build_dataset(DatasetConfig(name="random", num_prompts=10, input_len=8, output_len=2, seed=4), tok)
    assert [r.prompt_ids for r in plain] == [r.prompt_ids for r in reqs]   # same prompts, priorities added
    assert all(r.priority is None for r in plain)
