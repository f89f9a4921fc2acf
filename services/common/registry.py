"""Worker discovery: workers announce a `WorkerInfo`, routers read a snapshot of them per role.

Torch-free and asyncio. Backends plug in through `register_registry` (a Kubernetes-endpoints
registry is the next one); callers build them with `create_registry(name, **kwargs)`.

Lifecycle, the same for every backend: create → `start()` → serve (`announce` / `update_load` on a
worker; `workers(role)` / `refresh()` on a router) → `close()`, which is safe to call twice.
A backend's I/O errors are logged and retried in the background; they never escape a background
task, and a router keeps routing to its last known snapshot while the backend is unreachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

Role = int  # a worker_pb2.WorkerRole value
Listener = Callable[[], Awaitable[None]]

ROLE_NAMES: dict[int, str] = {
    worker_pb2.WORKER_ROLE_PREFILL: "prefill",
    worker_pb2.WORKER_ROLE_DECODE: "decode",
    worker_pb2.WORKER_ROLE_COLOCATED: "colocated",
}


def _identity(info: worker_pb2.WorkerInfo) -> tuple:
    # What routing and channels depend on; load changes every heartbeat and is not part of it.
    return (info.worker_id, info.role, info.grpc_addr, info.bootstrap_addr, info.model, info.pod_uid, info.boot_epoch)


class WorkerRegistry(ABC):
    """Where workers announce themselves and routers find them.

    `workers(role)` is a cheap synchronous read of the latest snapshot (the backend refreshes it in
    the background, or on `refresh()`). Listeners added with `add_listener` are awaited after a
    refresh that changed the set of workers (not merely their load).
    """

    def __init__(self) -> None:
        self._by_role: dict[int, list[worker_pb2.WorkerInfo]] = {}
        self._identities: frozenset[tuple] = frozenset()
        self._listeners: list[Listener] = []

    @abstractmethod
    async def start(self) -> None:
        """Connect and take the first snapshot (never raises for an unreachable backend)."""

    @abstractmethod
    async def close(self) -> None:
        """Withdraw this process's announcement, stop background tasks, disconnect. Idempotent."""

    @abstractmethod
    async def refresh(self) -> None:
        """Re-read the workers now (errors are logged; the previous snapshot is kept)."""

    async def announce(self, info: worker_pb2.WorkerInfo) -> None:
        """Worker side: publish `info` and keep it alive until `withdraw()` / `close()`."""
        raise NotImplementedError(f"{type(self).__name__} does not accept announcements")

    def update_load(self, load: worker_pb2.WorkerLoad) -> None:
        """Worker side: the load the next heartbeat publishes."""
        raise NotImplementedError(f"{type(self).__name__} does not accept announcements")

    async def report(self, load: worker_pb2.WorkerLoad) -> None:
        """Worker side: publish `load` now, not at the next heartbeat (what it serves changed)."""
        self.update_load(load)

    async def withdraw(self) -> None:
        """Worker side: remove this process's announcement now (no-op when nothing was announced)."""
        return None

    def workers(self, role: Role) -> list[worker_pb2.WorkerInfo]:
        """Router side: the live workers of `role`, in a stable order. Do not mutate them."""
        return list(self._by_role.get(role, ()))

    def all_workers(self) -> list[worker_pb2.WorkerInfo]:
        return [w for ws in self._by_role.values() for w in ws]

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    async def _publish(self, infos: Iterable[worker_pb2.WorkerInfo]) -> None:
        by_role: dict[int, list[worker_pb2.WorkerInfo]] = {}
        for info in infos:
            by_role.setdefault(info.role, []).append(info)
        identities = frozenset(_identity(w) for ws in by_role.values() for w in ws)
        self._by_role = by_role
        if identities == self._identities:
            return
        added = {i[0] for i in identities} - {i[0] for i in self._identities}
        removed = {i[0] for i in self._identities} - {i[0] for i in identities}
        self._identities = identities
        log.info("workers changed: +%s -%s", sorted(added), sorted(removed))
        for listener in list(self._listeners):
            try:
                await listener()
            except Exception:
                log.exception("registry listener failed")


class _OutageLog:
    """Logs the first failure of an outage as a warning and the recovery once, not every retry."""

    def __init__(self, what: str):
        self.what = what
        self.down = False

    def failed(self, exc: BaseException) -> None:
        if not self.down:
            log.warning("%s failed (will retry): %s", self.what, exc)
        else:
            log.debug("%s still failing: %s", self.what, exc)
        self.down = True

    def ok(self) -> None:
        if self.down:
            log.info("%s recovered", self.what)
        self.down = False


CANCEL_WAIT_S = 2.0


async def _cancel(task: asyncio.Task | None, wait_s: float = CANCEL_WAIT_S) -> None:
    """Cancel a background loop and wait for it, at most `wait_s`: a cancellation swallowed inside a
    client library (seen with a Redis write that a SIGSTOP/SIGCONT left mid-flight) must not hang
    the worker's stop (the launcher then SIGKILLed it after its grace)."""
    if task is None:
        return
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=wait_s)
    if not done:
        log.warning("%s did not end within %.0fs of its cancellation: left behind", task.get_name(), wait_s)
        return
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.result()


def _cancel_requested() -> bool:
    """Whether the running task has a cancellation pending (3.11's Task.cancelling): a loop checks it
    after a call that may have swallowed the CancelledError."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


_REGISTRIES: dict[str, Callable[..., WorkerRegistry]] = {}


def register_registry(name: str) -> Callable[[Callable[..., WorkerRegistry]], Callable[..., WorkerRegistry]]:
    """Class decorator: make a registry backend available to `create_registry(name, ...)`."""

    def deco(factory: Callable[..., WorkerRegistry]) -> Callable[..., WorkerRegistry]:
        assert name not in _REGISTRIES, f"registry {name!r} registered twice"
        _REGISTRIES[name] = factory
        return factory

    return deco


def registry_names() -> list[str]:
    return sorted(_REGISTRIES)


def create_registry(name: str, **kwargs) -> WorkerRegistry:
    try:
        factory = _REGISTRIES[name]
    except KeyError:
        raise ValueError(f"unknown registry {name!r}; known: {', '.join(registry_names())}") from None
    return factory(**kwargs)


@register_registry("redis")
class RedisRegistry(WorkerRegistry):
    """Workers in Redis: key `{prefix}:worker:{worker_id}` holds the serialized WorkerInfo with a TTL.

    A worker's heartbeat re-writes its key every `heartbeat_s` (with the latest load), so a worker
    that dies without withdrawing disappears within `ttl_s`. With `watch=True` (routers) a background
    task SCANs the keys every `poll_s`; workers pass `watch=False`. `url` is any redis-py URL,
    including `unix:///path/to/redis.socket`.
    """

    def __init__(
        self,
        url: str,
        ttl_s: float = 3.0,
        heartbeat_s: float = 1.0,
        prefix: str = "tandem",
        poll_s: float = 0.5,
        watch: bool = True,
    ):
        super().__init__()
        if not 0 < heartbeat_s < ttl_s:
            raise ValueError(f"need 0 < heartbeat_s < ttl_s, got heartbeat_s={heartbeat_s} ttl_s={ttl_s}")
        self.url = url
        self.ttl_s = ttl_s
        self.heartbeat_s = heartbeat_s
        self.prefix = prefix
        self.poll_s = poll_s
        self.watch = watch
        self._client = None
        self._info: worker_pb2.WorkerInfo | None = None
        self._heartbeat_task: asyncio.Task | None = None
        self._poll_task: asyncio.Task | None = None
        self._closed = False
        self._write_log = _OutageLog(f"registry heartbeat to {url}")
        self._read_log = _OutageLog(f"registry scan of {url}")
        self._run_id = ""               # the Redis instance last read (INFO run_id): a new one restarted
        self._rejoin_until = 0.0
        self._unreachable = False       # the last read failed: on the next that succeeds, keep the known workers a TTL

    def key(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    async def start(self) -> None:
        import redis.asyncio as aioredis  # imported here: no client library work at module import

        assert not self._closed, "RedisRegistry is closed"
        if self._client is not None:
            return
        # Timeouts keep a hung Redis from stalling a heartbeat past the TTL it is meant to refresh.
        self._client = aioredis.from_url(
            self.url, socket_timeout=self.ttl_s, socket_connect_timeout=self.ttl_s
        )
        if self.watch:
            await self.refresh()
            self._poll_task = asyncio.create_task(self._poll_loop(), name="registry-poll")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await _cancel(self._poll_task)
        self._poll_task = None
        await self.withdraw()
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.aclose()
            self._client = None

    async def announce(self, info: worker_pb2.WorkerInfo) -> None:
        assert self._client is not None, "call start() before announce()"
        assert info.worker_id, "WorkerInfo.worker_id is required"
        self._info = worker_pb2.WorkerInfo()
        self._info.CopyFrom(info)
        await self._write()
        if self._heartbeat_task is None:
            self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name="registry-heartbeat")

    def update_load(self, load: worker_pb2.WorkerLoad) -> None:
        if self._info is not None:
            self._info.load.CopyFrom(load)

    async def report(self, load: worker_pb2.WorkerLoad) -> None:
        self.update_load(load)
        if self._info is not None and self._client is not None:
            await self._write()

    async def withdraw(self) -> None:
        await _cancel(self._heartbeat_task)
        self._heartbeat_task = None
        info, self._info = self._info, None
        if info is None or self._client is None:
            return
        try:
            await self._client.delete(self.key(info.worker_id))
        except Exception as e:  # the key still expires after ttl_s
            log.warning("could not withdraw %s from the registry: %s", info.worker_id, e)

    async def refresh(self) -> None:
        if self._client is None:
            return
        try:
            keys = [k async for k in self._client.scan_iter(match=self.key("*"), count=1000)]
            values = await self._client.mget(keys) if keys else []
            server = await self._client.info("server")
        except Exception as e:
            self._read_log.failed(e)
            self._unreachable = True
            return
        self._read_log.ok()
        if self._unreachable:
            # While this side could not reach Redis (partitioned, or Redis itself was), the workers may
            # not have reached it either: their keys expired, and they come back with their next
            # heartbeat. Keep the workers we knew until then, as after a Redis restart.
            self._unreachable = False
            log.warning("registry %s reachable again: keeping the last known workers for %.1fs while "
                        "they re-announce", self.url, self.ttl_s)
            self._rejoin_until = time.monotonic() + self.ttl_s
        infos = []
        for key, value in zip(keys, values, strict=True):
            if value is None:  # expired between SCAN and MGET
                continue
            info = worker_pb2.WorkerInfo()
            try:
                info.ParseFromString(value)
            except Exception:
                log.warning("ignoring unparsable registry entry %r", key)
                continue
            infos.append(info)
        run_id = str(server.get("run_id", ""))
        if self._run_id and run_id != self._run_id:
            log.warning("registry %s restarted (empty until workers re-announce): keeping the last known "
                        "workers for %.1fs", self.url, self.ttl_s)
            self._rejoin_until = time.monotonic() + self.ttl_s
        self._run_id = run_id
        if time.monotonic() < self._rejoin_until:
            # Redis restarted and is empty until every live worker's next heartbeat: keep the workers
            # we knew until they had the time to re-announce.
            seen = {i.worker_id for i in infos}
            infos += [w for w in self.all_workers() if w.worker_id not in seen]
        infos.sort(key=lambda w: w.worker_id)
        await self._publish(infos)

    async def _write(self) -> None:
        assert self._info is not None and self._client is not None
        try:
            await self._client.set(
                self.key(self._info.worker_id), self._info.SerializeToString(), px=int(self.ttl_s * 1000)
            )
        except Exception as e:
            self._write_log.failed(e)
        else:
            self._write_log.ok()

    async def _heartbeat_loop(self) -> None:
        while not _cancel_requested():
            await asyncio.sleep(self.heartbeat_s)
            if self._info is not None:
                await self._write()

    async def _poll_loop(self) -> None:
        while not _cancel_requested():
            await asyncio.sleep(self.poll_s)
            await self.refresh()


@register_registry("static")
class StaticRegistry(WorkerRegistry):
    """A fixed list of worker addresses (`--prefill/--decode/--colocated`).

    An address is not a worker's identity: pairing needs each worker's id and boot epoch (a decode
    worker checks them in the bootstrap handshake), and a worker restarted at the same address is a
    new one. So, as the Kubernetes registry does for its endpoints, the registry asks every address
    what is there (`WorkerIdentity.GetWorkerInfo`: id, role, boot epoch, model, limits, load) and
    lists that, at the address it was given. A worker without that service (UNIMPLEMENTED) is listed
    by its address: worker_id = grpc_addr = bootstrap_addr = the address and `model` as given (empty
    matches any requested model); one that answers with another role than its list's is skipped.

    With `probe_s > 0` every address is asked again, and health-checked over gRPC, every `probe_s`:
    only those answering SERVING (or that have no health service) and that said what they are are
    listed, and a restarted worker's new identity replaces the old one. With `probe_s == 0` each is
    asked at start only and never dropped. The order of the lists is kept.
    """

    def __init__(
        self,
        prefill: Sequence[str] = (),
        decode: Sequence[str] = (),
        colocated: Sequence[str] = (),
        model: str = "",
        probe_s: float = 2.0,
        probe_timeout_s: float = 1.0,
        channel: Callable[[str], grpc.aio.Channel] = grpc.aio.insecure_channel,
    ):
        """`channel(addr)` opens the probes' channels (InternalAuth.channel: TLS when configured)."""
        super().__init__()
        self._open = channel
        self.probe_s = probe_s
        self.probe_timeout_s = probe_timeout_s
        self._configured: list[worker_pb2.WorkerInfo] = []   # what an address stands for when nothing says more
        for role, addrs in (
            (worker_pb2.WORKER_ROLE_PREFILL, prefill),
            (worker_pb2.WORKER_ROLE_DECODE, decode),
            (worker_pb2.WORKER_ROLE_COLOCATED, colocated),
        ):
            for addr in addrs:
                self._configured.append(
                    worker_pb2.WorkerInfo(worker_id=addr, role=role, grpc_addr=addr, bootstrap_addr=addr, model=model)
                )
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._probe_task: asyncio.Task | None = None
        self._started = False
        self._closed = False

    async def start(self) -> None:
        assert not self._closed, "StaticRegistry is closed"
        if self._started:
            return
        self._started = True
        await self.refresh()
        if self.probe_s > 0:
            self._probe_task = asyncio.create_task(self._probe_loop(), name="registry-probe")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await _cancel(self._probe_task)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    async def refresh(self) -> None:
        described = await asyncio.gather(*(self._describe(w) for w in self._configured))
        if self.probe_s <= 0:   # never dropped: what could not be asked stands for its address
            await self._publish(info or w for w, info in zip(self._configured, described, strict=True))
            return
        alive = await asyncio.gather(*(self._probe(w.grpc_addr) for w in self._configured))
        await self._publish(info for info, ok in zip(described, alive, strict=True) if ok and info is not None)

    def _channel(self, addr: str) -> grpc.aio.Channel:
        channel = self._channels.get(addr)
        if channel is None:
            channel = self._channels[addr] = self._open(addr)
        return channel

    async def _describe(self, configured: worker_pb2.WorkerInfo) -> worker_pb2.WorkerInfo | None:
        """What the worker at `configured.grpc_addr` says it is (None: it did not say)."""
        addr = configured.grpc_addr
        try:
            info = await worker_pb2_grpc.WorkerIdentityStub(self._channel(addr)).GetWorkerInfo(
                worker_pb2.WorkerInfoRequest(), timeout=self.probe_timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:   # no identity service: known by its address
                return configured
            log.debug("worker at %s did not describe itself: %s", addr, e.code().name)
            return None
        if info.role != configured.role:
            log.warning("%s is listed as a %s worker but the worker there is %s: skipped", addr,
                        ROLE_NAMES.get(configured.role), worker_pb2.WorkerRole.Name(info.role))
            return None
        # The address the router was given is the one it (and a decode worker, for the bootstrap) can
        # reach, whatever the worker advertises.
        if info.bootstrap_addr == info.grpc_addr:
            info.bootstrap_addr = addr
        info.grpc_addr = addr
        return info

    async def _probe(self, addr: str) -> bool:
        try:
            resp = await health_pb2_grpc.HealthStub(self._channel(addr)).Check(
                health_pb2.HealthCheckRequest(), timeout=self.probe_timeout_s
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # no health service: reachable is enough
                return True
            log.debug("health probe of %s failed: %s", addr, e.code().name)
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("static registry probe failed")
