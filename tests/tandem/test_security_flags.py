"""The shared-secret and API-key flags reach every child of `tandem up`, through argv (a file path)
or the environment (a secret), never a secret on a command line."""

from __future__ import annotations

from tandem.cli.main import build_parser
from tandem.cli.up_cmd import gateway_args, router_args, worker_args
from tandem.services.common.auth import API_KEY_ENV, TOKEN_ENV
from tandem.services.launcher.up import UpConfig, _children_env, _router_env


def test_a_token_file_given_to_up_goes_to_workers_router_and_gateway(tmp_path):
    path = str(tmp_path / "token")
    up = build_parser().parse_args(["up", "--internal-token-file", path])
    for role in ("prefill", "decode", "colocated"):
        assert build_parser().parse_args([role, *worker_args(up)]).internal_token_file == path
    router = build_parser().parse_args(["router", "--prefill", "a:1", "--decode", "b:2", *router_args(up)])
    assert router.internal_token_file == path
    assert build_parser().parse_args(["gateway", *gateway_args(up)]).internal_token_file == path
    assert "--internal-token-file" not in worker_args(build_parser().parse_args(["up"]))


def test_up_gives_its_children_a_secret_in_their_environment_and_the_key_to_the_api_services(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    env = _children_env(UpConfig())
    assert len(env[TOKEN_ENV]) >= 32
    assert _children_env(UpConfig())[TOKEN_ENV] != env[TOKEN_ENV]            # fresh per deployment
    assert API_KEY_ENV not in _router_env(UpConfig(), env)
    assert _router_env(UpConfig(api_key="sk-1"), env)[API_KEY_ENV] == "sk-1"
    monkeypatch.setenv(TOKEN_ENV, "operator-chosen-secret-123")
    assert _children_env(UpConfig())[TOKEN_ENV] == "operator-chosen-secret-123"
    assert TOKEN_ENV not in _children_env(UpConfig(internal_token_file="/etc/tandem/token"))
