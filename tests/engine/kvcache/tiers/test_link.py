"""The model fingerprint in every block key: it changes with config.json and with the weight files'
names and sizes, and not with anything else in the folder."""

from __future__ import annotations

from tandem.engine.kvcache.tiers.link import model_fingerprint


def test_fingerprint_follows_config_and_weight_files(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    (tmp_path / "model.safetensors").write_bytes(bytes(100))
    base = model_fingerprint(tmp_path)
    assert model_fingerprint(tmp_path) == base
    (tmp_path / "README.md").write_text("not a weight")
    assert model_fingerprint(tmp_path) == base
    (tmp_path / "model.safetensors").write_bytes(bytes(101))
    assert model_fingerprint(tmp_path) != base
    (tmp_path / "model.safetensors").write_bytes(bytes(100))
    assert model_fingerprint(tmp_path) == base
    (tmp_path / "config.json").write_text('{"hidden_size": 65}')
    assert model_fingerprint(tmp_path) != base
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001.safetensors")
    assert model_fingerprint(tmp_path) != base
