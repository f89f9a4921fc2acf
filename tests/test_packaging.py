"""What `make install` installs: one import name of Tandem's own, and exactly what locks/ says.

Tandem's source folders (engine/, kernels/, ...) are installed as tandem.engine, tandem.kernels, ...
(setup.py). Top-level names like `kernels` belong to other distributions: transformers imports
Hugging Face's `kernels`, and a `kernels` of ours next to it broke every worker at import once. These
tests fail if the distribution exposes another top-level name, if a subpackage is left out of the
wheel, if the checkout's folders can shadow an installed package, or if .venv drifts from the lock.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("engine", "services", "kvtransfer", "kernels", "bench")
LOCKS = ROOT / "locks"
# Installed by `make install` beside the locks: editable installs of this checkout.
OURS = {"tandem", "tandem-client"}
IN_PROJECT_VENV = Path(sys.prefix).resolve() == (ROOT / ".venv").resolve()
project_venv = pytest.mark.skipif(not IN_PROJECT_VENV, reason="checks the .venv `make install` made")


def installed() -> dict:
    """name -> distribution of .venv's site-packages (not what a package vendors and puts on sys.path:
    setuptools adds its own copies of packaging & co. once imported)."""
    site = sysconfig.get_paths()["purelib"]
    return {canonicalize_name(d.metadata["Name"]): d for d in importlib.metadata.distributions(path=[site])}


def locked(*names: str) -> dict[str, str]:
    """name -> version of every `name==version` line of the lock files."""
    out: dict[str, str] = {}
    for name in names:
        for m in re.finditer(r"^([A-Za-z0-9_.\-]+)==(\S+)", (LOCKS / name).read_text(), re.M):
            out[canonicalize_name(m.group(1))] = m.group(2)
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """A wheel of the checkout as `pip install .` (or the Dockerfile) would build it."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in (*FOLDERS, "tandem"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "results"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(out), str(src)], check=True, capture_output=True, timeout=300)
    [whl] = out.glob("tandem-*.whl")
    return zipfile.ZipFile(whl)


def test_the_wheel_holds_one_top_level_name_and_every_module(wheel):
    names = wheel.namelist()
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"tandem"}
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert wheel.read(top_level).decode().split() == ["tandem"]
    # Every module of every folder, under tandem/ (a subpackage setup.py missed would be absent).
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            assert f"tandem/{path.relative_to(ROOT).as_posix()}" in names
    # What the CPU kernels compile from where they run.
    assert {"tandem/kernels/cpu/ops.cpp", "tandem/kernels/cpu/kernels.h"} <= set(names)


def test_the_installed_distribution_takes_only_tandem():
    dist = importlib.metadata.distribution("tandem")
    assert (dist.read_text("top_level.txt") or "").split() == ["tandem"]
    # An editable install maps names to folders: every name it maps is tandem or below it.
    finders = [f for f in sys.meta_path if type(f).__module__.startswith("__editable___tandem_0")]
    for finder in finders:
        mapping = sys.modules[type(finder).__module__].MAPPING
        assert mapping and all(name == "tandem" or name.startswith("tandem.") for name in mapping), mapping


def test_the_checkouts_folders_shadow_nothing_from_anywhere(tmp_path):
    """Started the way Tandem starts its processes (-P), from the checkout or any other directory, the
    checkout's folders are never top-level packages, and tandem.* resolves to this checkout."""
    probe = ("import importlib.util, json, sys, tandem.kernels, tandem.engine; "
             "print(json.dumps({n: getattr(importlib.util.find_spec(n), 'origin', None) "
             "for n in ('kernels', 'engine', 'services', 'bench')} | "
             "{'tandem.kernels': tandem.kernels.__file__, 'path': sys.path}))")
    for cwd in (ROOT, tmp_path):
        out = subprocess.run([sys.executable, "-P", "-c", probe], cwd=cwd, capture_output=True, text=True,
                             check=True, timeout=60)
        found = json.loads(out.stdout)
        assert found["tandem.kernels"] == str(ROOT / "kernels" / "__init__.py")
        for name in ("kernels", "engine", "services", "bench"):
            assert found[name] != str(ROOT / name / "__init__.py"), (cwd, name)
        assert str(ROOT) not in found["path"] and "" not in found["path"]


@project_venv
def test_hugging_faces_kernels_is_the_one_transformers_gets():
    # The package that collided: transformers (today's releases) imports it, and Tandem still imports.
    if "kernels" not in {canonicalize_name(Requirement(r).name) for r in importlib.metadata.requires("transformers") or ()
                         if Requirement(r).marker is None}:
        pytest.skip("this transformers does not depend on Hugging Face's kernels")
    out = subprocess.run([sys.executable, "-P", "-c", "import kernels, transformers.integrations.hub_kernels, "
                          "tandem.engine.tokenizer.tokenizer, tandem.kernels.cpu; print(kernels.__file__)"],
                         cwd=ROOT, capture_output=True, text=True, check=True, timeout=120)
    assert "site-packages" in out.stdout


@project_venv
def test_the_venv_is_the_lock():
    """Every locked package at its locked version, and nothing installed that no lock names."""
    want = locked("tandem.lock", "no-deps.lock", "uv.lock")
    have = {name: d.version for name, d in installed().items()}
    assert {n: (v, have.get(n)) for n, v in want.items() if have.get(n) != v} == {}
    assert set(have) - set(want) - OURS == set()


@project_venv
def test_every_installed_requirement_is_met_but_those_installed_without_deps():
    no_deps = set(locked("no-deps.lock"))
    have = installed()
    missing = []
    for name, dist in have.items():
        if name in no_deps:
            continue
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            got = have.get(canonicalize_name(req.name))
            if got is None or not req.specifier.contains(got.version, prereleases=True):
                missing.append(f"{name} needs {req}, has {got.version if got else 'nothing'}")
    assert missing == []


def test_every_lock_pins_with_hashes():
    for lock in sorted(LOCKS.glob("*.lock")):
        text = lock.read_text()
        pins = re.findall(r"^([A-Za-z0-9_.\-]+)==\S+ \\\n((?:    --hash=sha256:[0-9a-f]{64}(?: \\)?\n)+)", text, re.M)
        assert pins, lock
        assert len(pins) == len(re.findall(r"^[A-Za-z0-9_.\-]+==", text, re.M)), f"{lock}: a pin without a hash"
        assert not re.search(r"^[A-Za-z0-9_.\-]+(>=|<=|~=|>|<)", text, re.M), f"{lock}: a range is not a lock"
