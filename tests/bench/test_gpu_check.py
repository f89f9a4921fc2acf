"""`make gpu-check` and `make gpu-bundle` on a machine without a GPU: the run says there is no GPU and
exits 0; the runner's JSON for parts that fail, time out or crash; the bundle's size and version
checks without downloading; the tables that pick the CUDA test subset; the NIXL part's checksum.
The parts themselves need a GPU (docs/gpu-check.md); two of them also run on CPU, in the slow suite."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from tandem.bench.gpu_check import bundle, part_tests
from tandem.bench.gpu_check.nixl_peer import digest, untouched_nonzero
from tandem.bench.gpu_check.part_nixl import expand, page_runs
from tandem.bench.gpu_check.runner import Part, Run, link_checkout, run_all, run_part

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """The parts' environment as `make gpu-check` makes it: this tree's tandem and tests through links."""
    return dict(os.environ, PYTHONPATH=str(link_checkout(tmp_path_factory.mktemp("site"))))


# ---- the run on a machine without a GPU ----------------------------------------------------------------

def test_make_gpu_check_without_a_gpu_says_so_and_exits_0(tmp_path, env):
    assert not torch.cuda.is_available()
    out = subprocess.run(["make", "-s", "gpu-check", f"GPU_CHECK_ARGS=--out {tmp_path}/gpu_check.json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "no GPU on this machine" in out.stdout and "nothing to check" in out.stdout
    assert not (tmp_path / "gpu_check.json").exists()


def test_no_gpu_where_one_is_required_fails_loudly(env):
    out = subprocess.run([sys.executable, "-P", "-m", "tandem.bench.gpu_check", "--require-gpu"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "FAILED" in out.stderr and "cannot use it" in out.stderr


# ---- the runner: one JSON, every failure named --------------------------------------------------------

def fake_part(name: str, body: str, timeout_s: float = 30.0) -> Part:
    code = "import time\nfrom tandem.bench.gpu_check.report import main_of, require\n" + textwrap.dedent(body)
    return Part(name, (sys.executable, "-c", code), timeout_s, what=f"fake {name}")


PASSES = """
def run(report, args):
    report.details["gbps"] = 123.0
main_of(run)
"""
FAILS = """
def run(report, args):
    report.details["max_abs_diff"] = 0.5
    require(False, "triton and torch differ by 0.5")
main_of(run)
"""
HANGS = """
def run(report, args):
    report.details["started"] = True
    report.save()
    time.sleep(120)
main_of(run)
"""
CRASHES = "import os\nprint('segfault, say')\nos._exit(3)\n"


def test_the_run_json_names_each_failed_part_and_keeps_what_it_measured(tmp_path, env):
    run = Run(out=tmp_path / "gpu_check.json", log=tmp_path / "gpu_check.log", header={"machine": {"gpu": "fake"}})
    parts = [fake_part("ok", PASSES), fake_part("wrong", FAILS), fake_part("hang", HANGS, timeout_s=6),
             fake_part("crash", CRASHES)]
    run_all(parts, env, budget_s=120, run=run)
    doc = json.loads(run.out.read_text())
    assert doc["ok"] is False and doc["failed"] == ["wrong", "hang", "crash"]
    assert doc["machine"] == {"gpu": "fake"} and doc["total_s"] > 0
    assert list(doc["parts"]) == ["ok", "wrong", "hang", "crash"]
    for p in doc["parts"].values():
        assert set(p) >= {"ok", "status", "what", "seconds", "timeout_s", "exit_code", "error", "details", "log_tail"}
    ok, wrong, hang, crash = (doc["parts"][n] for n in ("ok", "wrong", "hang", "crash"))
    assert (ok["ok"], ok["status"], ok["error"], ok["details"]) == (True, "passed", None, {"gbps": 123.0})
    assert (wrong["ok"], wrong["status"], wrong["exit_code"]) == (False, "failed", 1)
    assert wrong["error"] == "triton and torch differ by 0.5" and wrong["details"] == {"max_abs_diff": 0.5}
    assert hang["status"] == "timeout" and hang["error"] == "timed out after 6 s (killed)"
    assert hang["details"] == {"started": True} and 6 <= hang["seconds"] < 20     # what it saved before
    assert crash["status"] == "crashed" and crash["exit_code"] == 3 and "segfault, say" in crash["error"]
    assert "[wrong] FAILED: triton and torch differ by 0.5" in run.log.read_text()


def test_a_part_the_budget_has_no_room_for_is_not_run(env):
    outcome = run_part(fake_part("late", PASSES), env, budget_left_s=2.0)
    assert outcome["ok"] is False and outcome["status"] == "not_run"
    assert "budget" in outcome["error"]


def test_a_failed_bundle_install_fails_the_run():
    run = Run(out=None, log=None, header={"bundle": {"ok": False, "error": "pip: no such wheel"}})
    run.parts["ok"] = {"ok": True}
    assert run.as_dict()["failed"] == ["bundle"] and run.as_dict()["ok"] is False


# ---- the bundle, without downloading -------------------------------------------------------------------

def test_size_check_passes_under_the_limit_and_fails_over_it():
    assert bundle.check_budget(40 << 20, 2 << 20) is None
    assert bundle.check_budget(62 << 20, 2 << 20) is None                      # exactly 64 MiB
    problem = bundle.check_budget(63 << 20, 2 << 20)
    assert "65.0 MiB exceeds the 64.0 MiB" in problem and "over by 1.0 MiB" in problem


def test_gpu_bundle_check_command_fails_when_the_folder_is_too_big(tmp_path, capsys):
    big = tmp_path / "wheels" / "big.whl"
    big.parent.mkdir()
    with open(big, "wb") as f:
        f.truncate(3 << 20)                     # sparse: 3 MiB counted, nothing written
    (tmp_path / "link.whl").symlink_to(big)     # links travel as links: not counted twice
    assert bundle.dir_bytes(tmp_path) == 3 << 20
    tree = bundle.tree_bytes()
    assert tree > 0
    limit = (3 << 20) + tree
    assert bundle.main(["check", "--dir", str(tmp_path), "--limit-mib", str((limit - 1) / (1 << 20))]) == 1
    assert "FAILED" in capsys.readouterr().err
    assert bundle.main(["check", "--dir", str(tmp_path), "--limit-mib", str(limit / (1 << 20))]) == 0


def test_stub_requirements_and_the_carried_runtimes(tmp_path):
    (tmp_path / "a_pb2.py").write_text("# Protobuf Python Version: 7.35.1\n")
    (tmp_path / "b_pb2.py").write_text("# Protobuf Python Version: 7.34.0\n")
    (tmp_path / "a_pb2_grpc.py").write_text("GRPC_GENERATED_VERSION = '1.85.1'\n")
    need = bundle.stub_requirements(tmp_path)
    assert need == {"protobuf": "7.35.1", "grpcio": "1.85.1"}
    assert bundle.check_stub_runtime(need) == []
    old = [bundle.Wheel("protobuf", "6.33.0", ""), bundle.Wheel("grpcio", "1.80.0", "")]
    problems = bundle.check_stub_runtime(need, old)
    assert any("protobuf >= 7.35.1" in p for p in problems) and any("grpcio >= 1.85.1" in p for p in problems)
    assert "another major" in bundle.check_stub_runtime({"protobuf": "7.35.1"}, [bundle.Wheel("protobuf", "8.0.0", "")])[0]
    assert bundle.check_stub_runtime({"grpcio": "1.0"}, [])[0].endswith("no grpcio wheel is carried")


def test_the_generated_stubs_import_under_the_carried_runtimes():
    need = bundle.stub_requirements(bundle.STUB_DIR)
    assert set(need) == {"protobuf", "grpcio"}, "run `make proto`"
    assert bundle.check_stub_runtime(need) == []


def test_requirements_of_carried_wheels_are_carried_or_preinstalled():
    problems = bundle.check_requirements({"x": ["numpy>=1.17", "PySide6>=6.9; extra == 'gui'",
                                                "nixl-cu12==1.5.1", "grpcio>=1.85.1", "redis>=5"]})
    assert problems == ["x needs redis>=5: neither carried nor on the GPU machine"]
    assert bundle.check_requirements({"x": ["protobuf<7,>=6"]}) == [
        "x needs protobuf<7,>=6; the bundle carries protobuf 7.36.2"]
    # The wheels this venv has of the carried versions (nixl-cu13 is the GPU's variant: not here).
    installed = {}
    for w in bundle.WHEELS:
        try:
            if importlib.metadata.version(w.name) == w.version:
                installed[w.name] = importlib.metadata.requires(w.name) or []
        except importlib.metadata.PackageNotFoundError:
            pass
    assert len(installed) >= 5
    assert bundle.check_requirements(installed) == []


def test_trim_wheel_drops_the_members_and_their_record_lines(tmp_path):
    whl = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("pkg/__init__.py", "x = 1\n")
        z.writestr("pkg_extra/big.so", b"\0" * 100_000)
        z.writestr("pkg-1.0.dist-info/RECORD", "pkg/__init__.py,sha256=a,6\npkg_extra/big.so,sha256=b,100000\n"
                                               "pkg-1.0.dist-info/RECORD,,\n")
    assert bundle.trim_wheel(whl, ("pkg_extra/",)) > 0
    with zipfile.ZipFile(whl) as z:
        assert z.namelist() == ["pkg/__init__.py", "pkg-1.0.dist-info/RECORD"]
        assert "pkg_extra" not in z.read("pkg-1.0.dist-info/RECORD").decode()


IMPORTS = """
import builtins, importlib, json, sys
FIRST = {"tandem", "tests"}
seen, real = set(), builtins.__import__
def record(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and globals and (globals.get("__name__") or "").split(".")[0] in FIRST:
        seen.add(name.split(".")[0])
    return real(name, globals, locals, fromlist, level)
builtins.__import__ = record
for m in sys.argv[1:]:
    importlib.import_module(m)
print(json.dumps(sorted(seen - FIRST - set(sys.stdlib_module_names))))
"""

# What the parts load in their own processes (and, lazily, nixl): bench.gpu_check's modules, what
# they import inside functions, the CUDA test modules, and the services the disagg part starts.
RUNTIME_MODULES = [
    "tandem.bench.gpu_check.__main__", "tandem.bench.gpu_check.part_tests", "tandem.bench.gpu_check.part_kernels",
    "tandem.bench.gpu_check.part_engine", "tandem.bench.gpu_check.part_nixl", "tandem.bench.gpu_check.part_disagg",
    "tandem.bench.gpu_check.models", "tandem.bench.kernels", "tandem.bench.engine", "tandem.engine.engine", "tandem.kvtransfer.backends.nixl",
    "tandem.kernels.rmsnorm", "tandem.kernels.rope", "tandem.kernels.kv_store", "tandem.kernels.kv_pack", "tandem.kernels.lora",
    "tandem.kernels.decode_attention",
    "tests.fixtures.tiny_models", "tandem.cli", "tandem.services.prefill.role", "tandem.services.decode.role",
    "tandem.services.router.server", "tandem.v1.generation_pb2_grpc",
    "tests.engine.test_engine_vs_hf", "tests.engine.test_bf16_parity", "tests.kernels.helpers",
    "tests.conftest", "tests.kernels.conftest",
]


def test_what_the_parts_import_is_on_the_gpu_machine_or_carried(env):
    out = subprocess.run([sys.executable, "-P", "-c", IMPORTS, *RUNTIME_MODULES], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    names = set(json.loads(out.stdout.splitlines()[-1])) | {"nixl"}
    dists = importlib.metadata.packages_distributions()
    missing = {}
    for name in names:
        found = {bundle.normalize(d) for d in dists.get(name, [name])}
        if not found & (bundle.PREINSTALLED | bundle.carried_names()):
            missing[name] = sorted(found)
    assert not missing, f"imported by the parts, neither on the GPU machine nor in the bundle: {missing}"


# ---- the CUDA test subset --------------------------------------------------------------------------------

def test_every_cuda_test_module_is_found_once_and_every_deselected_test_exists():
    for name in part_tests.CUDA_TESTS:
        part_tests.find(name)
    for node in part_tests.DESELECT:
        name, test = node.split("::")
        assert name in part_tests.CUDA_TESTS
        assert re.search(rf"^def {test}\(", part_tests.find(name).read_text(), re.MULTILINE), node
    args = part_tests.pytest_args(Path("/tmp/j.xml"))
    assert args.count("--deselect") == len(part_tests.DESELECT)
    assert "tests/engine/test_triton_backend.py" in args


def test_every_test_module_that_can_take_a_cuda_path_is_classified():
    unclassified = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.name == Path(__file__).name:
            continue
        text = path.read_text()
        if re.search("cuda", text, re.IGNORECASE) or "tests.kernels.helpers" in text:
            if (path.name not in part_tests.CUDA_TESTS and path.name not in part_tests.NOT_CUDA
                    and not path.name.startswith(part_tests.NOT_CUDA_PREFIX)):
                unclassified.append(str(path.relative_to(ROOT)))
    assert not unclassified, ("list these in bench/gpu_check/part_tests.py: CUDA_TESTS if CUDA changes "
                              f"what they run, else NOT_CUDA: {unclassified}")


def test_junit_summary_lists_what_did_not_pass(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text("""<testsuites><testsuite>
      <testcase classname="tests.a" name="test_ok"/>
      <testcase classname="tests.a" name="test_bad"><failure message="assert 1 == 2">tb</failure></testcase>
      <testcase classname="tests.b" name="test_err"><error message="fixture broke"/></testcase>
      <testcase classname="tests.b" name="test_skip"><skipped message="needs X"/></testcase>
    </testsuite></testsuites>""")
    s = part_tests.junit_summary(xml)
    assert (s["tests"], s["passed"], s["failures"], s["errors"], s["skipped"]) == (4, 1, 1, 1, 1)
    assert [(b["test"], b["outcome"]) for b in s["not_passed"]] == [
        ("tests.a::test_bad", "failure"), ("tests.b::test_err", "error"), ("tests.b::test_skip", "skipped")]
    assert s["not_passed"][0]["message"] == "assert 1 == 2"


# ---- the NIXL part's page runs and checksum ------------------------------------------------------------------

def test_page_runs_do_not_overlap_and_cover_the_same_pages_on_both_sides():
    runs = page_runs(2048, seed=1)
    assert len(runs) > 50 and runs[:, 2].min() >= 1 and runs[:, 2].max() <= 16
    for col in (0, 1):
        pages = expand(runs, col)
        assert len(pages) == len(set(pages)) == runs[:, 2].sum() <= 1024
        assert min(pages) >= 0 and max(pages) < 2048
    assert expand(runs, 0) != expand(runs, 1)


def test_digest_sees_a_misplaced_page_and_a_changed_element():
    pool = torch.randn(2, 2, 16, 4, 2, 8)
    pages = [3, 7, 1, 12]
    base = digest(pool, pages)
    assert digest(pool.clone(), pages) == base
    assert digest(pool, [7, 3, 1, 12]) != base
    changed = pool.clone()
    changed[1, 1, 12, 3, 1, 7] += 1
    assert digest(changed, pages) != base
    zeros = torch.zeros(2, 2, 16, 4, 2, 8)
    zeros[:, :, pages] = 1
    assert untouched_nonzero(zeros, pages) == 0
    zeros[0, 1, 5, 0, 0, 0] = 2
    assert untouched_nonzero(zeros, pages) == 1


# ---- parts that also run without a GPU (DRAM, CPU engine) -----------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("part", ["part_nixl", "part_disagg"])
def test_part_runs_on_cpu(tmp_path, part, env):
    result = tmp_path / "result.json"
    out = subprocess.run([sys.executable, "-P", "-m", f"tandem.bench.gpu_check.{part}", "--device", "cpu", "--result", str(result),
                          "--timeout-s", "240"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    doc = json.loads(result.read_text())
    assert out.returncode == 0 and doc["ok"] is True, (doc["error"], out.stdout[-3000:])
    if part == "part_nixl":
        assert [r["verified"] for r in doc["details"]["runs"]] == [True, True]
    else:
        assert doc["details"]["requests"]["tokens"] == doc["details"]["requests"]["expected"]


# ---- small pieces of the run ---------------------------------------------------------------------------------

def test_a_static_worker_that_lost_its_port_starts_again_on_a_new_one(monkeypatch):
    from tandem.bench.gpu_check import part_disagg
    from tandem.bench.gpu_check.report import CheckFailed

    class Exited:
        def poll(self):
            return 1

    class FakeProc:
        def __init__(self, name, argv, env, error=None):
            self.name, self.argv, self.proc, self.error = name, argv, Exited(), error

        def wait_ready(self, timeout_s):
            if self.error:
                raise CheckFailed(f"{self.name} exited with 1: {self.error}")
            return {"grpc_addr": self.argv[-1]}

    monkeypatch.setattr(part_disagg, "Proc", FakeProc)
    procs: list = []
    lost = FakeProc("decode", ["decode", "--port", "1"], {}, error="Failed to bind to address 127.0.0.1:1")
    info = part_disagg.ready_static(lost, ["decode"], {}, 5.0, procs)
    assert len(procs) == 1 and procs[0].argv[:2] == ["decode", "--port"] and info["grpc_addr"].startswith("127.0.0.1:")
    with pytest.raises(CheckFailed, match="bad model"):     # any other failure is not retried
        part_disagg.ready_static(FakeProc("decode", ["decode"], {}, error="bad model"), ["decode"], {}, 5.0, [])
    always = FakeProc("decode", ["decode"], {}, error="Failed to bind")
    monkeypatch.setattr(part_disagg, "Proc", lambda *a: FakeProc(*a, error="Failed to bind"))
    with pytest.raises(CheckFailed, match="bind"):
        part_disagg.ready_static(always, ["decode"], {}, 5.0, [])


def test_place_stubs_copies_what_is_missing_or_differs(tmp_path):
    (tmp_path / "b" / "stubs").mkdir(parents=True)
    dest = tmp_path / "v1"
    dest.mkdir()
    for name, text in (("a_pb2.py", "A"), ("a_pb2_grpc.py", "G"), ("b_pb2.py", "B")):
        (tmp_path / "b" / "stubs" / name).write_text(text)
    (dest / "a_pb2.py").write_text("A")
    (dest / "b_pb2.py").write_text("old")
    assert bundle.place_stubs(tmp_path / "b", dest) == ["a_pb2_grpc.py", "b_pb2.py"]
    assert (dest / "b_pb2.py").read_text() == "B"


def test_device_peak_from_clock_and_bus_width(monkeypatch):
    import types

    from tandem.bench.gpu_check import gpu

    # An H200 as CUDA's device properties describe it (kHz, bits), then as only NVML does (MHz).
    props = types.SimpleNamespace(memory_clock_rate=3_201_000, memory_bus_width=6144)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    assert gpu.device_peak_gbps()[0] == pytest.approx(4916.7, abs=0.1)
    nvml = types.SimpleNamespace(NVML_CLOCK_MEM=2, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
                                 nvmlDeviceGetHandleByPciBusId=lambda bus: ("bus", bus),
                                 nvmlDeviceGetHandleByIndex=lambda i: ("index", i),
                                 nvmlDeviceGetMaxClockInfo=lambda h, kind: 3201,
                                 nvmlDeviceGetMemoryBusWidth=lambda h: 6144)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0))
    peak, how = gpu.device_peak_gbps()
    assert peak == pytest.approx(4916.7, abs=0.1) and how.startswith("NVML: 3201 MHz x 6144 bit")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace())
    nvml.nvmlDeviceGetMemoryBusWidth = lambda h: 1 / 0
    peak, how = gpu.device_peak_gbps()
    assert peak is None and how.startswith("neither")


def test_parts_are_chosen_by_name_and_the_json_goes_to_out(monkeypatch, tmp_path):
    from tandem.bench.gpu_check.__main__ import PARTS, default_out, select

    assert [p.name for p in select("nixl, tests")] == ["nixl", "tests"]
    with pytest.raises(SystemExit, match="--parts"):
        select("tests,gpu")
    assert sum(p.timeout_s for p in PARTS.values()) <= 450          # the budget's room, bundle install aside
    monkeypatch.setenv("OUT", str(tmp_path))
    assert default_out() == tmp_path / "gpu_check.json"
    monkeypatch.delenv("OUT")
    assert default_out() == ROOT / "bench" / "results" / "gpu_check.json"
