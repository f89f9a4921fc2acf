"""`tandem gateway`'s command line -> GatewayConfig."""

from __future__ import annotations

import argparse

import pytest

from tandem.cli import gateway_cmd
from tandem.services.common.auth import API_KEY_ENV
from tandem.services.gateway.config import GatewayConfig


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    gateway_cmd.add_arguments(p)
    return p.parse_args(argv)


def test_defaults_and_flags(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    config = GatewayConfig.from_args(parse([]))
    assert (config.host, config.port, config.router, config.api_key) == ("127.0.0.1", 8000, "127.0.0.1:50051", None)
    config = GatewayConfig.from_args(parse(["--port", "0", "--router", "10.0.0.1:5", "--api-key", "k",
                                            "--max-inflight", "7", "--tokenizer", "/m"]))
    assert (config.port, config.router, config.api_key, config.max_inflight, config.tokenizer) == \
        (0, "10.0.0.1:5", "k", 7, "/m")


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert GatewayConfig.from_args(parse([])).api_key == "from-env"
    assert GatewayConfig.from_args(parse(["--api-key", "flag"])).api_key == "flag"


@pytest.mark.parametrize("argv", [["--port", "70000"], ["--max-inflight", "0"], ["--api-key", ""]])
def test_bad_values_are_rejected(argv, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(ValueError):
        GatewayConfig.from_args(parse(argv))
