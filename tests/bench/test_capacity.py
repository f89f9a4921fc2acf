"""Capacity at SLO: the rate search on synthetic deployments, the FLOP count, and `tandem bench sweep
--find-capacity` end to end against fake deployments (no model, no torch beyond the limit's matmul)."""

import json

import pytest

from tandem.bench.serve import capacity as cap
from tandem.bench.serve import sweep
from tests.bench.test_serve_and_sweep import FakeDeployment, cli


def _search(true_capacity: float, noise=lambda rate: None, **kw) -> cap.CapacitySearch:
    """A deployment that serves everything within the SLO up to `true_capacity` and 50% beyond."""
    s = cap.CapacitySearch(cap.CapacityConfig(**kw))
    while (rate := s.next_rate()) is not None:
        forced = noise(rate)
        s.record(rate, forced if forced is not None else (1.0 if rate <= true_capacity else 0.5))
    return s


@pytest.mark.parametrize("true_capacity", [0.3, 1.7, 3.0, 5.2, 11.0])
def test_the_search_brackets_the_capacity_and_narrows_it(true_capacity):
    s = _search(true_capacity, start_rate=1.0, bisect_steps=4)
    assert s.passed <= true_capacity < s.failed
    assert s.failed - s.passed <= max(1.0, s.failed) / 2 ** 3      # four bisections of the first bracket
    assert s.capacity == s.passed and not s.capped
    rates = [r for r, _ in s.tried]
    assert len(rates) == len(set(rates)) and len(rates) <= 4 + 5  # no rate run twice, a bounded search


def test_the_search_reports_what_it_could_not_reach():
    assert _search(100.0, start_rate=1.0, max_rate=8.0).capped
    assert _search(100.0, start_rate=1.0, max_rate=8.0).capacity == 8.0
    nothing = _search(0.0, start_rate=1.0, min_rate=0.2)
    assert nothing.capacity == 0.0 and [r for r, _ in nothing.tried] == [1.0, 0.5, 0.25]


def test_a_noisy_pass_above_a_failure_does_not_move_the_bracket():
    s = _search(2.0, noise=lambda rate: 1.0 if rate == 8.0 else None, start_rate=1.0, bisect_steps=2)
    assert 8.0 not in [r for r, _ in s.tried]             # never tried past the first failure (at 4)
    assert s.passed == 2.0 < s.failed <= 4.0
    s = cap.CapacitySearch(cap.CapacityConfig(start_rate=1.0))
    for rate, share in [(1.0, 1.0), (2.0, 1.0), (4.0, 0.5), (3.0, 0.95), (2.0, 0.5)]:
        s.record(rate, share)
    assert (s.passed, s.failed) == (1.0, 2.0)            # a later failure at 2 undoes the passes at and above it


def test_a_run_lasts_the_duration_at_any_rate():
    c = cap.CapacityConfig(duration_s=60)
    assert [c.num_prompts(r, 32) for r in (0.25, 0.5, 1.0, 4.0, 6.5)] == [32, 32, 60, 240, 390]
    assert cap.CapacityConfig(duration_s=0).num_prompts(8.0, 32) == 32


def test_bad_settings_are_refused():
    for kw in ({"goal": 0.0}, {"start_rate": 100.0}, {"seeds": 0}, {"duration_s": -1}):
        with pytest.raises(ValueError):
            cap.CapacityConfig(**kw).validate()


def test_request_flops_by_hand():
    # 1 layer, hidden 4, intermediate 8, q 4, kv 2, vocab 10: body = 4*(4+4) + 4*4 + 3*4*8 = 144 weights.
    shape = cap.ModelShape(layers=1, hidden=4, intermediate=8, q_size=4, kv_size=2, vocab=10)
    assert shape.body_params == 144
    prefill = 2 * 144 * 3 + 2 * 4 * 10 + 2 * 1 * 4 * 9          # 3 prompt tokens, the last one's logits
    decode = sum(2 * 144 + 2 * 4 * 10 + 4 * 1 * 4 * t for t in (4, 5))  # tokens 2 and 3 of the output
    assert cap.request_flops(shape, 3, 3) == prefill + decode
    limit = cap.compute_limit(shape, 3, 3, peak_flops=1e6)
    assert limit["rate"] == pytest.approx(1e6 / (prefill + decode))


def test_sweep_finds_each_deployments_capacity_and_the_limit(tokenizer_dir, tmp_path, monkeypatch, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text((tokenizer_dir / "tokenizer.json").read_text())
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5}))
    monkeypatch.setattr(sweep, "make_deployment", lambda name, cfg, echo=print: FakeDeployment(name))
    monkeypatch.setattr(sweep, "auto_dtype", lambda model: "float32")
    monkeypatch.setattr(cap, "measure_peak_flops", lambda dtype: 2e9)
    out = tmp_path / "cap.json"
    rc = cli("sweep", "--model", str(model), "--deployments", "colocated,vllm", "--find-capacity",
             "--capacity-start", "2", "--capacity-max", "8", "--capacity-seeds", "2", "--num-prompts", "4",
             "--input-len", "8", "--output-len", "3", "--num-warmups", "0", "--out", str(out), "--no-progress",
             "--no-save-requests", "--capacity-duration", "1.5")
    assert rc == 0
    res = json.loads(out.read_text())
    for name in ("colocated", "vllm"):
        c = res["deployments"][name]["capacity"]
        assert c["per_seed"] == [8.0, 8.0] and c["capped"]                 # a fake that keeps up with anything
        assert [r["request_rate"] for r in res["deployments"][name]["runs"]] == ["2", "4", "8"] * 2
        assert {r["seed"] for r in res["deployments"][name]["runs"]} == {0, 1}
        # 1.5 s of arrivals, at least --num-prompts 4: 4 at 2 req/s, 6 at 4, 12 at 8
        assert [r["metrics"]["completed"] for r in res["deployments"][name]["runs"]] == [4, 6, 12] * 2
    report = res["capacity"]
    assert report["limit"]["peak_gflop_s"] == 2.0
    assert report["deployments"]["colocated"]["vs_vllm"] == 1.0
    assert report["deployments"]["colocated"]["share_of_limit"] == pytest.approx(8.0 / report["limit"]["rate"])
    assert "capacity colocated: 8.00 req/s" in capsys.readouterr().out
    assert out.with_suffix(".capacity.png").stat().st_size > 0
