"""`tandem bench serve` against a live 1P1D stack (tiny model), over gRPC and the OpenAI HTTP gateway."""

from __future__ import annotations

import json

import pytest

from tandem.bench.serve.sweep import first_http_model
from tandem.cli.main import main
from tests.e2e.stack import API_KEY, gateway_stack

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def stack(request, tiny_llama):
    return gateway_stack(request.config, tiny_llama)


def bench(out, *argv: str) -> dict:
    rc = main(["bench", "serve", *argv, "--num-prompts", "8", "--input-len", "24", "--output-len", "6",
               "--range-ratio", "0.5", "--request-rate", "20", "--num-warmups", "1", "--slo", "ttft=30s,tpot=5s",
               "--out", str(out), "--no-progress", "--no-plot"])
    assert rc == 0
    return json.loads(out.read_text())["runs"][0]


def check(run: dict) -> None:
    m = run["metrics"]
    assert (m["completed"], m["failed"]) == (8, 0), m["failures"]
    assert m["good_requests"] == 8 and m["goodput"] > 0
    for r in run["requests"]:
        assert r["output_tokens"] == r["output_len"]          # ignore_eos: exact output lengths
        assert 0 < r["ttft_ms"] <= r["e2e_ms"] and len(r["itl_ms"]) >= 1
    assert m["total_input_tokens"] == sum(r["prompt_len"] for r in run["requests"])
    assert m["ttft"]["percentiles"]["p50"] > 0 and m["tpot"]["n"] == 8


def test_bench_serve_grpc(stack, tiny_llama, tmp_path):
    check(bench(tmp_path / "grpc.json", "--backend", "tandem-grpc", "--base-url", stack.info["router"],
                "--api-key", API_KEY, "--model", str(tiny_llama)))


def test_bench_serve_openai_http(stack, tiny_llama, tmp_path):
    url = stack.gateway_url
    name = first_http_model(url, api_key=API_KEY) or str(tiny_llama)
    check(bench(tmp_path / "http.json", "--backend", "openai-http", "--base-url", url, "--api-key", API_KEY,
                "--model", str(tiny_llama), "--served-model-name", name))


def test_bench_serve_reports_a_wrong_key(stack, tiny_llama, tmp_path, capsys):
    rc = main(["bench", "serve", "--backend", "openai-http", "--base-url", stack.gateway_url, "--api-key", "nope",
               "--model", str(tiny_llama), "--num-prompts", "1", "--input-len", "4", "--output-len", "2",
               "--num-warmups", "0", "--no-progress"])
    assert rc == 1 and "HTTP 401" in capsys.readouterr().out
