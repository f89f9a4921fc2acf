"""The `vllm` sweep deployment without vLLM: its command line and environment, the error when its venv is
missing, and start/teardown through the real code path with a tiny HTTP server in place of the api_server."""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.bench.serve import sweep
from tandem.bench.serve.sweep import DeploymentUnavailable, SweepConfig, VllmServe, make_deployment
from tandem.cli import bench_cmd

FAKE_SERVER = Path(__file__).with_name("fake_vllm_server.py")


def fake_venv(root: Path) -> Path:
    """A venv-shaped folder: bin/python (this interpreter) and an installed-looking vllm package."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").symlink_to(sys.executable)
    pkg = root / "lib" / "python3.11" / "site-packages" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    return root


def model_folder(root: Path) -> Path:
    root.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (root / name).write_text("{}")
    return root


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"  # a zombie (nobody reaps it in some containers) is gone


def test_command_line_and_environment(tmp_path):
    cfg = SweepConfig(model="m", vllm_venv=str(tmp_path / "v"), vllm_kv_cache_gb=3, vllm_max_model_len=1024,
                      vllm_args=("--max-num-seqs", "64"), dtype="bfloat16")
    dep = make_deployment("vllm", cfg)
    assert isinstance(dep, VllmServe) and dep.name == "vllm"
    assert dep.python() == tmp_path / "v" / "bin" / "python"
    assert dep.argv("/v/bin/python", "/models/m") == [
        "/v/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/m", "--host", "127.0.0.1",
        "--port", "PORT", "--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "64"]
    env = dep.env({"PATH": "/usr/bin", "PYTHONPATH": "/work/main", "VLLM_API_KEY": "k", "HOME": "/root"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["HOME"] == "/root"
    assert "PYTHONPATH" not in env and "VLLM_API_KEY" not in env          # not our modules; an open server
    assert env["PATH"].split(os.pathsep)[0] == str((tmp_path / "v" / "bin").resolve())
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert dep.describe().startswith("VLLM_CPU_KVCACHE_SPACE=3 ")
    assert SweepConfig().vllm_kv_cache_gb == 2 and SweepConfig().vllm_max_model_len == 2048


def test_venv_path_from_env_flag_and_default(monkeypatch):
    monkeypatch.delenv(sweep.VLLM_VENV_ENV, raising=False)
    assert SweepConfig().vllm_venv == str(sweep.ROOT / ".venv-vllm")
    monkeypatch.setenv(sweep.VLLM_VENV_ENV, "/opt/vv")
    assert SweepConfig().vllm_venv == "/opt/vv"
    seen = {}
    monkeypatch.setattr(sweep, "run_sweep", lambda cfg: seen.setdefault("cfg", cfg) and {"deployments": {"x": 1}})
    parser = argparse.ArgumentParser()
    bench_cmd.add_arguments(parser)
    assert bench_cmd.run(parser.parse_args(["sweep", "--deployments", "colocated,vllm"])) == 0
    cfg = seen.pop("cfg")
    assert cfg.deployments == ("colocated", "vllm") and cfg.vllm_venv == "/opt/vv"
    assert (cfg.vllm_kv_cache_gb, cfg.vllm_max_model_len, cfg.vllm_args) == (2, 2048, ())
    assert bench_cmd.run(parser.parse_args(
        ["sweep", "--deployments", "vllm", "--vllm-venv", "/x", "--vllm-kv-cache-gb", "4",
         "--vllm-max-model-len", "4096", "--vllm-args", "--max-num-seqs 8"])) == 0
    cfg = seen.pop("cfg")
    assert (cfg.vllm_venv, cfg.vllm_kv_cache_gb, cfg.vllm_max_model_len, cfg.vllm_args) == \
        ("/x", 4, 4096, ("--max-num-seqs", "8"))


def test_missing_venv_says_make_vllm_venv(tmp_path):
    dep = VllmServe(SweepConfig(vllm_venv=str(tmp_path / "nowhere")))
    with pytest.raises(DeploymentUnavailable, match=r"missing .*`make vllm-venv`"):
        dep.start()
    (tmp_path / "empty" / "bin").mkdir(parents=True)
    (tmp_path / "empty" / "bin" / "python").symlink_to(sys.executable)
    with pytest.raises(DeploymentUnavailable, match=r"vLLM is not installed in .*`make vllm-venv`"):
        VllmServe(SweepConfig(vllm_venv=str(tmp_path / "empty"))).start()
    dep.close()  # nothing started: a no-op


def test_sweep_skips_vllm_with_the_reason(tmp_path, monkeypatch, capsys):
    tok = tmp_path / "tok"
    tok.mkdir()
    from tests.bench.fakes import byte_level_bpe
    byte_level_bpe().save(str(tok / "tokenizer.json"))
    monkeypatch.setenv(sweep.VLLM_VENV_ENV, str(tmp_path / "nowhere"))
    parser = argparse.ArgumentParser()
    bench_cmd.add_arguments(parser)
    rc = bench_cmd.run(parser.parse_args(["sweep", "--model", str(tok), "--deployments", "vllm", "--dtype",
                                          "bfloat16", "--out", str(tmp_path / "s.json"), "--no-progress"]))
    assert rc == 1                                     # nothing measured
    assert "make vllm-venv" in json.loads((tmp_path / "s.json").read_text())["skipped"]["vllm"]
    assert "skipped vllm: vLLM's venv" in capsys.readouterr().out


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    record = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    monkeypatch.setattr(VllmServe, "entrypoint", (str(FAKE_SERVER),))
    monkeypatch.setattr(VllmServe, "progress_every_s", 0.0)
    monkeypatch.setattr(VllmServe, "stop_grace_s", 0.5)
    cfg = SweepConfig(model=str(model_folder(tmp_path / "model")), vllm_venv=str(fake_venv(tmp_path / "venv")),
                      vllm_kv_cache_gb=1, start_timeout_s=20)
    return cfg, record


def test_start_and_process_group_teardown(fake_vllm):
    cfg, record = fake_vllm
    lines = []
    dep = VllmServe(cfg, echo=lines.append)
    try:
        ep = dep.start()
        rec = json.loads(record.read_text())
        assert ep.backend == "openai-http" and ep.base_url == f"http://127.0.0.1:{dep.port}"
        assert ep.model == cfg.model and ep.force_output_len == "ignore-eos"   # the folder, as the server lists it
        assert rec["argv"][:2] == ["--model", cfg.model] and rec["argv"][rec["argv"].index("--port") + 1] == str(dep.port)
        assert rec["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1" and rec["cwd"] == str(Path(cfg.vllm_venv).resolve())
        leader, child = dep._proc.proc.pid, rec["child"]
        assert rec["pid"] == leader
        assert f"--model {cfg.model} " in dep.describe() and f"--port {dep.port} " in dep.describe()  # as it ran
        assert alive(leader) and alive(child)
    finally:
        t0 = time.monotonic()
        dep.close()
    assert not alive(leader) and not alive(child)    # the child ignored SIGTERM: killed with its group
    assert time.monotonic() - t0 < 5
    assert dep._proc is None and dep.log_tail() == ""
    dep.close()                                       # twice is fine


def test_server_that_exits_is_reported_with_its_output(fake_vllm):
    cfg, _ = fake_vllm
    dep = VllmServe(SweepConfig(**{**cfg.__dict__, "vllm_args": ("--exit-at-once",)}))
    with pytest.raises(DeploymentUnavailable, match=r"exited \(1\) before it was ready:\n.*No module named 'vllm'"):
        dep.start()
    dep.close()


def test_start_timeout_tears_down(fake_vllm, monkeypatch):
    cfg, _ = fake_vllm
    monkeypatch.setattr(sweep, "_http_ok", lambda url: False)   # never ready
    lines = []
    dep = VllmServe(SweepConfig(**{**cfg.__dict__, "start_timeout_s": 1.0}), echo=lines.append)
    with pytest.raises(DeploymentUnavailable, match="not ready in 1 s"):
        dep.start()
    pid = dep._proc.proc.pid
    dep.close()
    assert not alive(pid)
    assert lines and all(line.startswith("--- vllm: starting, ") for line in lines)   # progress lines


def test_targets_against_vllm():
    from tests.bench.test_serve_and_sweep import metrics

    def runs(*goodputs):
        return {"runs": [{"request_rate": str(i + 1), "metrics": metrics(g)} for i, g in enumerate(goodputs)]}
    res = {"deployments": {"colocated": runs(1.2, 0.5, 0.0), "1p1d": runs(0.99, 1.0, 0.0), "vllm": runs(1.0, 0.5, 0.0)}}
    checks = sweep.target_checks(res, SweepConfig())
    assert checks[-3:] == [
        "rate 1: vllm goodput 1.00 req/s; colocated 1.20, target >= 1.2x vllm: met; 1p1d 0.99, target >= 1x vllm: met",
        "rate 2: vllm goodput 0.50 req/s; colocated 0.50, target >= 1.2x vllm: missed; "
        "1p1d 1.00, target >= 1x vllm: met",
        "rate 3: vllm goodput 0.00 req/s; colocated 0.00, target >= 1.2x vllm: missed (both 0); "
        "1p1d 0.00, target >= 1x vllm: missed (both 0)"]
    del res["deployments"]["1p1d"]
    assert sweep.target_checks(res, SweepConfig())[0] == "targets: no disaggregated deployment in this sweep"
    assert len(sweep.target_checks(res, SweepConfig())) == 4


SWEEP_SCRIPT = """
import sys
from tandem.bench.serve import sweep
from tandem.bench.serve.datasets import DatasetConfig
sweep.VllmServe.entrypoint = (sys.argv[1],)
sweep.VllmServe.stop_grace_s = 0.5
sweep._http_ok = lambda url: False                           # never ready: SIGTERM arrives while it starts
sweep.run_sweep(sweep.SweepConfig(model=sys.argv[2], deployments=("vllm",), vllm_venv=sys.argv[3], start_timeout_s=60,
                                  dataset=DatasetConfig(num_prompts=1, input_len=4, output_len=2), out=sys.argv[4],
                                  dtype="bfloat16"))
"""


def test_sigterm_to_the_sweep_stops_the_server(fake_vllm, tmp_path):
    import subprocess
    cfg, record = fake_vllm
    (Path(cfg.model) / "tokenizer.json").unlink()
    from tests.bench.fakes import byte_level_bpe
    byte_level_bpe().save(str(Path(cfg.model) / "tokenizer.json"))
    sweeper = subprocess.Popen([sys.executable, "-c", SWEEP_SCRIPT, str(FAKE_SERVER), cfg.model, cfg.vllm_venv,
                                str(tmp_path / "s.json")], cwd=sweep.ROOT, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not record.exists():
            assert sweeper.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        rec = json.loads(record.read_text())
        sweeper.terminate()
        assert sweeper.wait(10) == 128 + 15
    finally:
        sweeper.kill()
    assert not alive(rec["pid"]) and not alive(rec["child"])


@pytest.mark.skipif(sweep.isa.host_level() in ("generic", "avx2"), reason="needs a CPU above AVX2 to cap")
def test_an_isa_cap_reaches_vllms_own_kernel_choice(tmp_path):
    """Under the AVX2 emulation variables the peer gets the sitecustomize that makes its CPUID checks
    answer as an AVX2-only CPU would, so it loads the kernels it would load there."""
    dep = make_deployment("vllm", SweepConfig(model="m", vllm_venv=str(tmp_path / "v")))
    env = dep.env({"PATH": "/usr/bin", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert env["TANDEM_PEER_ISA"] == "avx2" and env["PYTHONPATH"] == str(sweep.ISA_CAP_DIR)
    probe = "import torch.cpu as c; print(c._is_avx512_supported(), c._is_avx512_bf16_supported(), c._is_avx2_supported())"
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **{k: env[k] for k in
                         ("PYTHONPATH", "TANDEM_PEER_ISA")}}, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "True"]
