"""The child side of the conformance tests: holds transfer objects by key, answers over a Pipe."""

from __future__ import annotations

import json
import time

from tandem.kvtransfer import create_receiver, create_sender
from tandem.kvtransfer.base import PoolLayout
from tests.kvtransfer.helpers import page_bytes, random_pool, wait_done, wait_until


class _Host:
    def __init__(self) -> None:
        self.objs: dict[str, object] = {}

    def receiver(self, key: str, name: str, layout: PoolLayout, worker_id: str) -> bytes:
        rx = self.objs[key] = create_receiver(name, layout, "127.0.0.1", worker_id)
        return rx.metadata()

    def sender(self, key: str, name: str, layout: PoolLayout, worker_id: str, seed: int) -> None:
        self.objs[key] = create_sender(name, random_pool(layout, seed), layout, worker_id)

    def call(self, key: str, method: str, *args):
        return getattr(self.objs[key], method)(*args)

    def pages(self, key: str, pages: list[int]) -> list[bytes]:
        return page_bytes(self.objs[key].buffer, pages, self.objs[key].layout)

    def abort_and_snapshot(self, key: str, room: int, pages: list[int]) -> tuple[int, list[bytes]]:
        """Once data flows into the room, abort it, then read its pages right after abort() returns.
        Returns (bytes received before the abort, pages)."""
        rx = self.objs[key]
        wait_until(lambda: rx.poll(room).bytes_moved > 0)
        rx.abort(room)
        return rx.poll(room).bytes_moved, page_bytes(rx.buffer, pages, rx.layout)

    def wait(self, key: str, room: int, timeout: float = 10.0):
        rx = self.objs[key]
        return wait_done(lambda: rx.poll(room), timeout)

    def segment_path(self, key: str) -> str:
        return json.loads(self.objs[key].metadata())["shm"]["path"]

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def main(conn) -> None:
    host = _Host()
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            return
        if method == "exit":
            for obj in host.objs.values():
                obj.close()
            conn.send((True, None))
            return
        try:
            conn.send((True, getattr(host, method)(*args)))
        except Exception as e:  # handed to the parent, which re-raises it
            conn.send((False, e))
