"""Sampling defaults from the model's generation_config.json: read once with the model, filled into
every request that leaves a field unset, whatever the entry point (gRPC workers, `tandem generate`,
the Python API); a request's own values win; a folder without recommendations keeps Tandem's."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from tandem.cli import generate_cmd
from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.errors import InvalidRequest
from tandem.engine.models.config import generation_defaults, load_sampling_defaults
from tandem.engine.sampling_params import MODEL_DEFAULT_FIELDS, SamplingDefaults, SamplingParams
from tandem.services.common.convert import sampling_from_pb
from tandem.v1 import generation_pb2 as pb
from tests.fixtures.model_folders import with_generation_config

RECOMMENDED = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
UNSET = SamplingParams(max_tokens=4, **dict.fromkeys(MODEL_DEFAULT_FIELDS))


def engine_on(folder: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), dtype="float32", page_size=4, max_total_tokens=256,
                                  context_length=64))


def test_fill_takes_the_defaults_for_unset_fields_only():
    UNSET.validate()                                            # unset passes: the defaults are checked
    # OpenAI's, on every API: an unset temperature samples (vLLM's and SGLang's rule too).
    assert [getattr(SamplingDefaults().fill(UNSET), f) for f in MODEL_DEFAULT_FIELDS] == [1.0, 1.0, -1, 0.0, 1.0]
    model = SamplingDefaults().with_model(RECOMMENDED)
    assert model.from_model == ("temperature", "top_p", "top_k")
    got = model.fill(replace(UNSET, temperature=0.0, top_k=-1))
    assert (got.temperature, got.top_k, got.top_p, got.min_p) == (0.0, -1, 0.9, 0.0)    # explicit values win
    explicit = SamplingParams()
    assert model.fill(explicit) is explicit
    assert "temperature 0.6" in model.describe() and "from the model's generation_config.json" in model.describe()
    assert "recommends none" in SamplingDefaults().describe()
    with pytest.raises(InvalidRequest, match="temperature"):
        SamplingDefaults().with_model({"temperature": 3.0})


def test_generation_config_values_are_read_and_bad_ones_left_out(tmp_path, caplog):
    assert generation_defaults(tmp_path) == {}                  # no file
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 1, "do_sample": True, "temperature": 0.7, "top_k": 40.0, "top_p": 0, "min_p": "low",
        "repetition_penalty": None, "max_new_tokens": 256}))
    with caplog.at_level(logging.WARNING, logger="tandem.engine.models.config"):
        assert generation_defaults(tmp_path) == {"temperature": 0.7, "top_k": 40}
    assert "top_p must be in (0, 1]" in caplog.text and "min_p must be a number" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tandem.engine.models.config"):
        defaults = load_sampling_defaults(tmp_path)
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.7, 40, 1.0)
    assert any(r.levelno == logging.WARNING and "temperature 0.7" in r.getMessage() for r in caplog.records)
    (tmp_path / "generation_config.json").write_text("{not json")
    assert generation_defaults(tmp_path) == {}


@pytest.fixture(scope="module")
def recommending(tiny_llama, tmp_path_factory) -> LLMEngine:
    return engine_on(with_generation_config(tiny_llama, tmp_path_factory.mktemp("m") / "model", **RECOMMENDED))


def _generate_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    generate_cmd.add_arguments(p)
    return p.parse_args(["--prompt", "x", *argv])


def test_every_entry_point_gets_the_models_defaults_and_explicit_values_win(recommending):
    engine = recommending
    grpc_unset = sampling_from_pb(pb.SamplingParams(max_tokens=4))
    cli_unset = generate_cmd.sampling_from_args(_generate_args("--max-tokens", "4"))
    for i, params in enumerate((UNSET, grpc_unset, cli_unset)):
        p = engine.make_request([5, 6, 7], params, rid=f"unset-{i}").params
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == pytest.approx(
            (0.6, 0.9, 20, 0.0, 1.0)), i
        engine.forget(f"unset-{i}")
    grpc_explicit = sampling_from_pb(pb.SamplingParams(max_tokens=4, temperature=0.0, top_k=-1, top_p=0.5))
    cli_explicit = generate_cmd.sampling_from_args(_generate_args("--max-tokens", "4", "--temperature", "0",
                                                                  "--top-k", "-1", "--top-p", "0.5"))
    for i, params in enumerate((grpc_explicit, cli_explicit)):
        p = engine.make_request([5, 6, 7], params, rid=f"explicit-{i}").params
        assert (p.temperature, p.top_k, p.top_p) == pytest.approx((0.0, -1, 0.5)), i
        assert p.is_greedy
        engine.forget(f"explicit-{i}")
    # and generates with them: an explicit temperature 0 over the gRPC API is greedy
    greedy = engine.generate([[5, 6, 7]], replace(UNSET, temperature=0.0, max_tokens=8, seed=1))[0].token_ids
    assert engine.generate([[5, 6, 7]], replace(grpc_explicit, max_tokens=8))[0].token_ids == greedy


def test_a_folder_without_recommendations_takes_openais_defaults_on_grpc_too(tiny_llama):
    engine = engine_on(tiny_llama)
    assert engine.sampling_defaults == SamplingDefaults()
    p = engine.make_request([5, 6, 7], sampling_from_pb(pb.SamplingParams(max_tokens=4)), rid="r").params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (1.0, 1.0, -1, 0.0, 1.0)
    assert not p.is_greedy                                      # the same as an HTTP request without one
