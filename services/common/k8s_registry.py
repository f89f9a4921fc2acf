"""Kubernetes discovery (`--discovery k8s`): workers are the ready endpoints of Tandem's worker Services.

The router lists and then watches the EndpointSlices (discovery.k8s.io/v1) in one namespace that match
a label selector; each slice's `tandem.ai/role` label (copied from its Service) says the role of its
endpoints. Only endpoints whose `ready` condition holds and that are not terminating are used, so a
worker that fails its readiness probe or starts draining (SIGTERM flips its gRPC health to
NOT_SERVING) leaves the pool as soon as the API server says so.

Endpoints carry addresses, not what the router needs to know about a worker (id, model, context
length, boot epoch, load): for every ready endpoint the registry asks the worker itself
(`WorkerIdentity.GetWorkerInfo`) and keeps asking every `info_poll_s`, which is also how load reaches
the least-load policy. A container restarted in place keeps its pod UID and address but has a new boot
epoch, so it is a new worker identity here; a pod recreated at a recycled address has a new UID, and the
process answering must report the UID the endpoint names, or it is not listed.

Threads: the `kubernetes` client is synchronous, so the list/watch runs in one daemon thread that only
updates the endpoint table and wakes the asyncio side; everything else runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from tandem.services.common.registry import WorkerRegistry, _cancel, _OutageLog, register_registry
from tandem.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

ROLE_LABEL = "tandem.ai/role"
ROLES = {
    "prefill": worker_pb2.WORKER_ROLE_PREFILL,
    "decode": worker_pb2.WORKER_ROLE_DECODE,
    "colocated": worker_pb2.WORKER_ROLE_COLOCATED,
}
DEFAULT_SELECTOR = "app.kubernetes.io/part-of=tandem"
_GONE = 410


@dataclass(frozen=True)
class Endpoint:
    """One ready worker address from an EndpointSlice."""

    role: int
    addr: str            # host:port of the worker's gRPC port
    pod_uid: str         # targetRef.uid ("" when the slice has no targetRef)
    pod_name: str


def ready_endpoints(slice_: dict, port_name: str = "grpc") -> list[Endpoint]:
    """The usable endpoints of one EndpointSlice (a raw API object). Per the API, a missing `ready`
    condition means ready; a terminating endpoint is never used."""
    labels = (slice_.get("metadata") or {}).get("labels") or {}
    role = ROLES.get(labels.get(ROLE_LABEL, ""))
    ports = [p for p in slice_.get("ports") or () if p.get("port")]
    port = next((p["port"] for p in ports if p.get("name") == port_name), None)
    if port is None and len(ports) == 1:
        port = ports[0]["port"]
    if role is None or port is None or slice_.get("addressType") not in ("IPv4", "IPv6"):
        return []
    out = []
    for ep in slice_.get("endpoints") or ():
        cond = ep.get("conditions") or {}
        if cond.get("ready") is False or cond.get("terminating") is True or not ep.get("addresses"):
            continue
        host = ep["addresses"][0]
        host = f"[{host}]" if ":" in host else host
        ref = ep.get("targetRef") or {}
        out.append(Endpoint(role, f"{host}:{port}", ref.get("uid", ""), ref.get("name", "")))
    return out


@register_registry("k8s")
class KubernetesRegistry(WorkerRegistry):
    """Router side only (workers do not announce: their pods' readiness is the announcement).

    `api_server` (e.g. "http://127.0.0.1:8001", a `kubectl proxy` or a test server) overrides the
    in-cluster service-account config, which is tried first, then ~/.kube/config.
    """

    def __init__(self, namespace: str = "default", selector: str = DEFAULT_SELECTOR, port_name: str = "grpc",
                 api_server: str | None = None, info_poll_s: float = 1.0, info_timeout_s: float = 1.0,
                 watch_timeout_s: int = 300, retry_s: float = 1.0,
                 channel: Callable[[str], grpc.aio.Channel] = grpc.aio.insecure_channel):
        """`channel(addr)` opens the channel workers are asked over (InternalAuth.channel: with the secret)."""
        super().__init__()
        self._open = channel
        self.namespace, self.selector, self.port_name = namespace, selector, port_name
        self.api_server = api_server
        self.info_poll_s, self.info_timeout_s = info_poll_s, info_timeout_s
        self.watch_timeout_s, self.retry_s = watch_timeout_s, retry_s
        self._lock = threading.Lock()
        self._slices: dict[str, list[Endpoint]] = {}       # slice name -> its ready endpoints
        self._synced = threading.Event()                    # the first list arrived
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._api = None
        self._thread: threading.Thread | None = None
        self._resp = None                                   # the watch response being read
        self._poll_task: asyncio.Task | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stop = threading.Event()
        self._closed = False
        self._api_log = _OutageLog(f"Kubernetes EndpointSlice watch in namespace {namespace}")

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        assert not self._closed, "KubernetesRegistry is closed"
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._api = await asyncio.to_thread(self._make_api)
        self._thread = threading.Thread(target=self._watch_loop, name="k8s-watch", daemon=True)
        self._thread.start()
        # Route from the first snapshot when the API answers quickly; never block start on it.
        await asyncio.to_thread(self._synced.wait, 5.0)
        await self.refresh()
        self._poll_task = asyncio.create_task(self._poll_loop(), name="k8s-registry-poll")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        resp = self._resp
        if resp is not None:
            with contextlib.suppress(Exception):
                resp.shutdown()      # unblocks the watch thread's read (urllib3 >= 2.3)
        await _cancel(self._poll_task)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    # --- router side -------------------------------------------------------------------------
    def endpoints(self) -> list[Endpoint]:
        with self._lock:
            return sorted({e for eps in self._slices.values() for e in eps}, key=lambda e: e.addr)

    async def refresh(self) -> None:
        endpoints = self.endpoints()
        infos = await asyncio.gather(*(self._describe(e) for e in endpoints))
        live = {e.addr for e in endpoints}
        for addr in [a for a in self._channels if a not in live]:
            await self._channels.pop(addr).close()
        await self._publish(sorted((i for i in infos if i is not None), key=lambda w: w.worker_id))

    async def _describe(self, ep: Endpoint) -> worker_pb2.WorkerInfo | None:
        channel = self._channels.get(ep.addr)
        if channel is None:
            channel = self._channels[ep.addr] = self._open(ep.addr)
        try:
            info = await worker_pb2_grpc.WorkerIdentityStub(channel).GetWorkerInfo(
                worker_pb2.WorkerInfoRequest(), timeout=self.info_timeout_s)
        except grpc.aio.AioRpcError as e:
            log.debug("worker at %s (pod %s) did not describe itself: %s", ep.addr, ep.pod_name, e.code().name)
            return None
        if info.role != ep.role:
            log.warning("endpoint %s is listed as %s but the worker there is %s", ep.addr,
                        worker_pb2.WorkerRole.Name(ep.role), worker_pb2.WorkerRole.Name(info.role))
            return None
        if ep.pod_uid and info.pod_uid and ep.pod_uid != info.pod_uid:
            # The address was recycled: the process answering is not the pod the endpoint names.
            log.warning("endpoint %s names pod uid %s but the worker answering is pod %s: skipped",
                        ep.addr, ep.pod_uid, info.pod_uid)
            return None
        info.grpc_addr = ep.addr     # the address the router can reach, whatever the worker advertised
        if not info.pod_uid:
            info.pod_uid = ep.pod_uid
        return info

    async def _poll_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.info_poll_s)
            self._wake.clear()
            try:
                await self.refresh()
            except Exception:
                log.exception("Kubernetes registry refresh failed")

    def _changed(self) -> None:   # watch thread
        loop = self._loop
        if loop is not None and not self._stop.is_set():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._wake.set)

    # --- the list/watch thread -----------------------------------------------------------------
    def _make_api(self):
        from kubernetes import client, config  # imported here: no client library work at module import

        cfg = client.Configuration()
        if self.api_server:
            cfg.host = self.api_server
        else:
            try:
                config.load_incluster_config(client_configuration=cfg)
            except config.ConfigException:
                config.load_kube_config(client_configuration=cfg)
        return client.DiscoveryV1Api(client.ApiClient(cfg))

    def _list(self) -> str:
        resp = self._api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=self.selector, _preload_content=False, _request_timeout=30)
        body = json.loads(resp.data)
        slices = {s["metadata"]["name"]: ready_endpoints(s, self.port_name) for s in body.get("items") or ()}
        with self._lock:
            self._slices = slices
        self._synced.set()
        self._changed()
        return (body.get("metadata") or {}).get("resourceVersion", "")

    def _watch_loop(self) -> None:
        from kubernetes.client.exceptions import ApiException

        rv = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    rv = self._list()
                rv = self._watch(rv)
                self._api_log.ok()
            except ApiException as e:
                if e.status == _GONE:      # our resourceVersion is too old: list again
                    rv = None
                    continue
                self._api_log.failed(e)
                rv = None
                self._stop.wait(self.retry_s)
            except Exception as e:
                if self._stop.is_set():
                    return
                self._api_log.failed(e)
                rv = None
                self._stop.wait(self.retry_s)

    def _watch(self, rv: str) -> str:
        """Apply watch events from `rv` until the server ends the stream; returns the last version."""
        from kubernetes.client.exceptions import ApiException
        from kubernetes.watch.watch import iter_resp_lines

        resp = self._api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=self.selector, watch=True, resource_version=rv,
            allow_watch_bookmarks=True, timeout_seconds=self.watch_timeout_s, _preload_content=False)
        self._resp = resp
        try:
            for line in iter_resp_lines(resp):
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise ApiException(status=obj.get("code", 500), reason=obj.get("message", "watch error"))
                meta = obj.get("metadata") or {}
                rv = meta.get("resourceVersion") or rv
                if kind == "BOOKMARK":
                    continue
                with self._lock:
                    if kind == "DELETED":
                        self._slices.pop(meta.get("name"), None)
                    else:
                        self._slices[meta.get("name")] = ready_endpoints(obj, self.port_name)
                self._changed()
                if self._stop.is_set():
                    break
        finally:
            self._resp = None
            resp.release_conn()
        return rv


def pod_namespace(path: str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace") -> str:
    """The namespace this pod runs in (the service-account mount), "default" outside a cluster."""
    try:
        with open(path) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"

