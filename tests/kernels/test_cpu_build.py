"""How the CPU kernels are built, cached and chosen (kernels/cpu/__init__.py, kernels/cpu/build.py): the
variant follows the ISA caps, a build killed midway blocks nobody, two checkouts share one build, and
two processes starting at once build once.

The tests that build real kernels use a temporary TANDEM_CACHE_DIR seeded with the torch binding from
the default cache (content-addressed, so a copy is as good as a build; it is the slow part), so each
compiles one `generic` variant (a few seconds). A fake compiler (`CXX`, a shell script) pauses a build
where a test needs it paused: it signals that it started, then waits for a file before it runs the
real compiler.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tandem.kernels.cpu import build, cache_dir, isa, runnable_levels
from tandem.kernels.cpu.build import Artifact, BuildError, cached, run

REPO = Path(__file__).resolve().parents[2]
COMPILING = "compiling Tandem's CPU kernels"


def _compiled(stderr: str) -> bool:
    """Whether the process logged that it compiles (not that it waits for another one that does)."""
    return any(line.startswith(COMPILING) for line in stderr.splitlines())


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the build exited early: {proc.communicate()}"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


def _paused_compiler(tmp: Path) -> tuple[Path, Path, Path]:
    """A CXX that touches `started` and waits for `go` before compiling (not for --version)."""
    started, go, script = tmp / "started", tmp / "go", tmp / "slow-c++"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case "$1" in --version) exec c++ "$@";; esac
        touch {started}
        while [ ! -e {go} ]; do sleep 0.05; done
        exec c++ "$@"
        """))
    script.chmod(0o755)
    return script, started, go


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "CXX")}
    return {**env, "TANDEM_CACHE_DIR": str(cache), **extra}


@pytest.fixture(scope="module")
def seeded_cache_root(tmp_path_factory) -> Path:
    """The default cache's torch binding (built here if need be), to copy into each test's cache."""
    build(["generic"])
    return cache_dir()


@pytest.fixture
def cache(tmp_path, seeded_cache_root) -> Path:
    """A fresh TANDEM_CACHE_DIR holding only the torch binding."""
    root = tmp_path / "cache"
    for entry in seeded_cache_root.glob("binding-*"):
        if (entry / "ready").is_dir():
            shutil.copytree(entry / "ready", root / "cpu_ops" / entry.name / "ready")
    return root


def _load_script(level: str, checkout: Path = REPO) -> str:
    """Load the kernels of `level` from `checkout`'s kernels/cpu (this one's is tandem.kernels.cpu; another
    checkout's is loaded from its files under the same name, as its own install would)."""
    if checkout == REPO:
        load = "import tandem.kernels.cpu as k\n"
    else:
        init = checkout / "kernels" / "cpu" / "__init__.py"
        load = ("import importlib.util, sys, tandem.kernels\n"
                f"spec = importlib.util.spec_from_file_location('tandem.kernels.cpu', {str(init)!r}, "
                f"submodule_search_locations=[{str(init.parent)!r}])\n"
                "k = importlib.util.module_from_spec(spec); sys.modules[spec.name] = k; spec.loader.exec_module(k)\n")
    return ("import logging; logging.basicConfig(level=logging.WARNING, format='%(message)s')\n" + load +
            f"ops = k.load({level!r})\n"
            "assert ops is not None\n"
            "print('LOADED', ops.LEVEL, ops.__file__, k.__file__)\n")


def _load(checkout: Path, cache: Path, level: str = "generic", **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-c", _load_script(level, checkout)], cwd=checkout,
                          env=_env(cache, **env), capture_output=True, text=True, timeout=300)


def _loaded(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 0, proc.stderr
    return next(line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("LOADED"))


@pytest.mark.slow   # ~1 min (builds the avx2 variant in a fresh cache); `make test-avx2` loads it by default
@pytest.mark.skipif(isa.host_level() not in ("avx2", "avx512", "avx512_bf16"), reason="needs an AVX2 CPU")
@pytest.mark.parametrize("caps", [{"ATEN_CPU_CAPABILITY": "avx2"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"},
                                  {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}])
def test_the_isa_caps_choose_the_avx2_variant(caps):
    """Under the AVX2 emulation the engine's `load()` gives the avx2 kernels (in a fresh process: the
    caps are read from its environment); without caps, the host's best."""
    script = "import tandem.kernels.cpu as k; ops = k.load(); print('LOADED', ops.LEVEL)"
    env = {**_env(cache_dir()), **caps}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    assert "LOADED avx2" in out.stdout
    plain = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_env(cache_dir()), capture_output=True,
                           text=True, timeout=600)
    assert f"LOADED {isa.host_level()}" in plain.stdout, plain.stderr


def test_a_level_this_cpu_cannot_run_is_refused():
    higher = [level for level in isa.LEVELS if level not in runnable_levels()]
    if not higher:
        pytest.skip("this CPU runs every level")
    with pytest.raises(ValueError, match="cannot run"):
        build([higher[0]])


def _tiny(src: Path, cxx: str) -> Artifact:
    """A one-function shared library built through the same cache, lock and publish code."""
    def compile_tiny(tmp: Path) -> None:
        shutil.copyfile(src, tmp / "tiny.cpp")
        run([cxx, "-shared", "-fPIC", "tiny.cpp", "-o", "tiny.so"], tmp)

    return Artifact("tiny", "k1", "tiny.so", compile_tiny, "a tiny library")


def build_tiny(root: str, src: str, cxx: str) -> None:
    """Entry point of the killed child (see the test below)."""
    cached(Path(root), _tiny(Path(src), cxx))


def test_a_build_killed_midway_blocks_no_later_start(tmp_path, caplog):
    """SIGKILL a build while its compiler runs: the lock dies with it, its half-built directory is never
    used, and the next build takes the lock at once (no waiting), cleans up and publishes."""
    import ctypes

    src = tmp_path / "tiny.cpp"
    src.write_text('extern "C" int answer(void) { return 42; }\n')
    root = tmp_path / "cache"
    slow, started, _ = _paused_compiler(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", "import sys; from tests.kernels.test_cpu_build import "
                              "build_tiny; build_tiny(*sys.argv[1:])", str(root), str(src), str(slow)],
                             cwd=REPO, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for(started, child)
        entry = root / "tiny-k1"
        with open(entry / "lock", "a") as f:          # the real lock is held now ...
            with pytest.raises(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert (entry / "lock").read_text().strip() == str(child.pid)
    finally:
        os.killpg(child.pid, signal.SIGKILL)        # the child and its compiler
        child.communicate()
    assert [p.name.startswith("build-") for p in entry.iterdir() if p.is_dir()] == [True]
    assert not (entry / "ready").exists()
    caplog.set_level("INFO", logger="tandem.kernels.cpu")
    t0 = time.monotonic()
    lib = cached(root, _tiny(src, "c++"), timeout_s=20)   # ... and free again: a wait would raise BuildError
    assert time.monotonic() - t0 < 20
    assert ctypes.CDLL(str(lib)).answer() == 42
    assert sorted(p.name for p in entry.iterdir()) == ["lock", "ready"]    # the dead build's directory is gone
    assert "waiting" not in caplog.text and "compiling a tiny library" in caplog.text


def test_a_wait_for_a_stuck_build_times_out(tmp_path):
    """A build that holds the lock and never finishes makes a waiter give up (with who holds it) rather
    than hang: the worker then runs the torch code."""
    root = tmp_path / "cache"
    entry = root / "tiny-k1"
    entry.mkdir(parents=True)
    with open(entry / "lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write("4242\n")
        f.flush()
        with pytest.raises(BuildError, match="process 4242"):
            cached(root, _tiny(tmp_path / "never.cpp", "c++"), timeout_s=0.5)


def test_real_kernels_killed_midway_then_loaded(tmp_path, cache):
    """The same with the kernels themselves: `load()` killed while it compiles, then a `load()` that
    proceeds and builds them."""
    slow, started, _ = _paused_compiler(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", _load_script("generic")], cwd=REPO, start_new_session=True,
                             env=_env(cache, CXX=str(slow)), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for(started, child)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
    [entry] = (cache / "cpu_ops").glob("generic-*")
    assert not (entry / "ready").exists()
    proc = _load(REPO, cache)
    assert _loaded(proc)[0] == "generic" and _compiled(proc.stderr) and "waiting" not in proc.stderr


def _checkout(at: Path) -> Path:
    """A copy of the kernels package (what a second clone of the repository holds)."""
    (at / "kernels").mkdir(parents=True)
    shutil.copyfile(REPO / "kernels" / "__init__.py", at / "kernels" / "__init__.py")
    shutil.copytree(REPO / "kernels" / "cpu", at / "kernels" / "cpu", ignore=shutil.ignore_patterns("__pycache__"))
    return at


def test_two_checkouts_share_one_build(tmp_path, cache):
    """Checkout A builds; checkout B (same sources, another path) loads A's build without compiling,
    and A again after B; a changed source is another build of its own."""
    a, b = _checkout(tmp_path / "a"), _checkout(tmp_path / "b")
    first = _load(a, cache)
    level, so, package = _loaded(first)
    assert _compiled(first.stderr) and package.startswith(str(a))
    for where in (b, a):
        again = _load(where, cache)
        assert _loaded(again)[:2] == [level, so] and _loaded(again)[2].startswith(str(where))
        assert not _compiled(again.stderr)
    assert len(list((cache / "cpu_ops").glob("generic-*"))) == 1
    with open(b / "kernels" / "cpu" / "ops.cpp", "a") as f:
        f.write("// a local change\n")
    changed = _load(b, cache)
    assert _compiled(changed.stderr) and _loaded(changed)[1] != so
    assert len(list((cache / "cpu_ops").glob("generic-*"))) == 2


def test_two_processes_starting_at_once_build_once(tmp_path, cache):
    """One process compiles (paused by the fake compiler until the other one waits); the other says it
    waits for that process, then loads the same build."""
    slow, started, go = _paused_compiler(tmp_path)
    logs = [tmp_path / "first.log", tmp_path / "second.log"]

    def start(log: Path) -> subprocess.Popen:
        with log.open("w") as err:
            return subprocess.Popen([sys.executable, "-c", _load_script("generic")], cwd=REPO,
                                    env=_env(cache, CXX=str(slow)), stdout=subprocess.PIPE, stderr=err, text=True)

    procs = [start(logs[0])]
    try:
        _wait_for(started, procs[0])               # the first one compiles, paused
        procs.append(start(logs[1]))
        waiting = f"waiting for process {procs[0].pid} to finish compiling Tandem's CPU kernels (generic)"
        deadline = time.monotonic() + 120
        while waiting not in logs[1].read_text():
            assert procs[1].poll() is None and time.monotonic() < deadline, logs[1].read_text()
            time.sleep(0.05)
        go.touch()
        loaded = [_loaded(subprocess.CompletedProcess(p.args, p.wait(timeout=300), p.stdout.read(),
                                                      log.read_text())) for p, log in zip(procs, logs, strict=True)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert loaded[0][:2] == loaded[1][:2]
    errs = [log.read_text() for log in logs]
    assert _compiled(errs[0]) and not _compiled(errs[1])
