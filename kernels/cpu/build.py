"""Content-addressed, locked builds of the CPU kernels' artifacts under `$TANDEM_CACHE_DIR/cpu_ops`.

One directory per artifact, named `<name>-<key>`, where the key hashes everything that determines
the output (the sources' contents, flags, compiler, torch and Python versions, ISA level) and nothing
else: not the checkout's path, so two checkouts with the same sources share one build and never
rebuild each other's, and different sources get different directories. Inside it:

- `lock`: an `fcntl.flock` lock, held by the one process that builds; it holds its pid (for the
  waiters' log line). The kernel drops a flock when its holder dies, so a build killed midway never
  blocks a later start.
- `build-<pid>-<random>/`: where that process copies the sources and runs the compiler (the
  compiler and its error messages see copies inside the cache, never a checkout's path).
- `ready/`: the finished build, published by renaming the build directory in one step. Only `ready/`
  is ever trusted, so a build killed midway leaves nothing a later one uses; the next builder (under
  the lock) deletes the leftovers.

Torch-free; the caller (kernels/cpu/__init__.py) says what to compile and with which flags.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tandem.kernels.cpu")

# A waiter gives up (and the worker runs the torch code) after this long: a build that takes longer
# is stuck, not slow (a cold build of every variant is ~1 min on two cores).
WAIT_TIMEOUT_S = 15 * 60
WAIT_LOG_EVERY_S = 60.0


class BuildError(RuntimeError):
    """A compile or link failed, or the wait for another process's build timed out."""


@dataclass(frozen=True)
class Artifact:
    """What to build: `build(dir)` writes `product` (and anything else it likes) into the empty
    directory `dir`; `key` must change whenever the output would."""
    name: str                                   # directory prefix; "avx2", "binding"
    key: str
    product: str                                # file name of the result inside `ready/`
    build: Callable[[Path], None]
    describe: str = ""                          # what the log lines call it
    estimate_s: float = 0.0                     # the cold build time the first log line quotes
    announce: bool = True                       # log compiling/compiled as warnings (else info)


def digest(parts: Iterable[str | bytes]) -> str:
    """A short hash of `parts` in order (each length-prefixed, so that no two lists collide)."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


def entry_dir(root: Path, artifact: Artifact) -> Path:
    return root / f"{artifact.name}-{artifact.key}"


def cached(root: Path, artifact: Artifact, timeout_s: float = WAIT_TIMEOUT_S) -> Path:
    """The path of `artifact`'s product, built first if no process has published it yet; at most one
    process builds it at a time, the others wait for that build and use it."""
    entry = entry_dir(root, artifact)
    product = entry / "ready" / artifact.product
    if product.exists():
        return product
    entry.mkdir(parents=True, exist_ok=True)
    with _locked(entry / "lock", artifact, timeout_s):
        if product.exists():              # built by the process we waited for
            return product
        for stale in entry.glob("build-*"):   # a killed build's leftovers: nobody else builds here now
            shutil.rmtree(stale, ignore_errors=True)
        tmp = entry / f"build-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        what = artifact.describe or artifact.name
        level = logging.WARNING if artifact.announce else logging.INFO
        log.log(level, "compiling %s for this CPU; first start after a change, ~%.0f s; later starts load them "
                "from %s", what, max(artifact.estimate_s, 1.0), entry)
        t0 = time.monotonic()
        try:
            artifact.build(tmp)
            if not (tmp / artifact.product).exists():
                raise BuildError(f"the build of {what} did not write {artifact.product}")
            os.rename(tmp, entry / "ready")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.log(level, "compiled %s in %.1f s (%s)", what, time.monotonic() - t0, entry)
    return product


class _locked:
    """An exclusive flock on `path` for the `with` block; logs while it waits for another holder."""

    def __init__(self, path: Path, artifact: Artifact, timeout_s: float):
        self.path, self.artifact, self.timeout_s = path, artifact, timeout_s
        self.fd = -1

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not self._try():
                self._wait()
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(self.fd)
            raise

    def __exit__(self, *exc) -> None:
        os.close(self.fd)                 # drops the flock

    def _try(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise

    def _wait(self) -> None:
        what = self.artifact.describe or self.artifact.name
        holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "another process"
        holder = f"process {holder}" if holder.isdigit() else holder
        log.warning("waiting for %s to finish compiling %s (%s)", holder, what, self.path.parent)
        t0 = time.monotonic()
        next_log = t0 + WAIT_LOG_EVERY_S
        while not self._try():
            now = time.monotonic()
            if now - t0 > self.timeout_s:
                raise BuildError(f"gave up after {self.timeout_s:.0f} s waiting for {holder} to finish compiling "
                                 f"{what} ({self.path.parent}; delete that directory if no build is running)")
            if now >= next_log:
                log.warning("still waiting for %s to finish compiling %s (%.0f s)", holder, what, now - t0)
                next_log = now + WAIT_LOG_EVERY_S
            time.sleep(0.1)


def run(cmd: list[str], cwd: Path, verbose: bool = False) -> None:
    """Runs one compiler command; a failure raises BuildError with the end of its output."""
    if verbose:
        log.warning("%s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise BuildError(f"no C++ compiler: {exc}") from exc
    if verbose and (proc.stdout or proc.stderr):
        log.warning("%s", (proc.stdout + proc.stderr).strip())
    if proc.returncode != 0:
        raise BuildError(f"{Path(cmd[0]).name} failed ({proc.returncode}): {(proc.stdout + proc.stderr).strip()[-2000:]}")


def compiler_id(cxx: str) -> str:
    """The compiler's identity for the cache key (its `--version` banner)."""
    try:
        proc = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"no C++ compiler ({cxx}): {exc}") from exc
    if proc.returncode != 0:
        raise BuildError(f"{cxx} --version failed: {proc.stderr.strip()[-500:]}")
    return proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else cxx
