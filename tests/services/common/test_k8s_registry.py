"""Kubernetes discovery against a fake API server on 127.0.0.1 (recorded EndpointSlices + a watch
stream) and fake workers on loopback addresses 127.0.0.2... that answer WorkerIdentity."""

from __future__ import annotations

import socket

import pytest

from tandem.services.common.k8s_registry import KubernetesRegistry, ready_endpoints
from tandem.services.common.registry import create_registry
from tandem.services.router.config import RouterConfig
from tandem.services.router.server import RouterServer
from tandem.v1 import worker_pb2
from tests.services.common.conftest import arun, wait_until
from tests.services.common.fake_kube_api import FakeKubeAPI, endpoint, recorded_slices
from tests.services.common.fake_worker import FakeWorker

PREFILL = worker_pb2.WORKER_ROLE_PREFILL
DECODE = worker_pb2.WORKER_ROLE_DECODE
SELECTOR = "app.kubernetes.io/part-of=tandem"


def free_port() -> int:
    # One port for every worker: an EndpointSlice has one port list for all its endpoints.
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        return s.getsockname()[1]


@pytest.fixture
def kube():
    api = FakeKubeAPI()
    yield api
    api.close()


def slices(port: int) -> dict[str, dict]:
    out = recorded_slices()
    for s in out.values():
        s["ports"][0]["port"] = port
    return out


def ids(registry, role) -> list[tuple[str, str, int]]:
    return [(w.worker_id, w.pod_uid, w.boot_epoch) for w in registry.workers(role)]


def test_ready_endpoints_parses_a_recorded_slice():
    s = recorded_slices()["prefill"]
    s["ports"][0]["port"] = 5000
    s["endpoints"] = [endpoint("10.0.0.7", "u1", "p-1"), endpoint("10.0.0.8", "u2", "p-2", ready=False),
                      endpoint("10.0.0.9", "u3", "p-3", terminating=True), {"addresses": ["10.0.0.10"]}]
    eps = ready_endpoints(s)
    assert [(e.role, e.addr, e.pod_uid, e.pod_name) for e in eps] == [
        (PREFILL, "10.0.0.7:5000", "u1", "p-1"), (PREFILL, "10.0.0.10:5000", "", "")]  # no conditions: ready
    s["metadata"]["labels"]["tandem.ai/role"] = "gateway"
    assert ready_endpoints(s) == []


def test_workers_appear_turn_unready_disappear_and_restart_with_a_new_uid(kube):
    async def body():
        port = free_port()
        s = slices(port)
        p0 = await FakeWorker("127.0.0.2", port, PREFILL, "prefill-a", "uid-a", 11).start()
        d0 = await FakeWorker("127.0.0.3", port, DECODE, "decode-b", "uid-b", 21).start()
        d1 = await FakeWorker("127.0.0.4", port, DECODE, "decode-c", "uid-c", 31).start()
        s["prefill"]["endpoints"] = [endpoint("127.0.0.2", "uid-a", "prefill-a")]
        s["decode"]["endpoints"] = [endpoint("127.0.0.3", "uid-b", "decode-b"),
                                    endpoint("127.0.0.4", "uid-c", "decode-c", ready=False)]
        kube.put(s["prefill"])
        kube.put(s["decode"])
        registry = create_registry("k8s", namespace="tandem", selector=SELECTOR, api_server=kube.url,
                                   info_poll_s=0.1, watch_timeout_s=2)
        changes = []

        async def on_change():
            changes.append(sorted(w.worker_id for w in registry.all_workers()))

        registry.add_listener(on_change)
        await registry.start()
        # The first snapshot: ready endpoints only, described by the workers themselves.
        assert ids(registry, PREFILL) == [("prefill-a", "uid-a", 11)]
        assert ids(registry, DECODE) == [("decode-b", "uid-b", 21)]
        [p] = registry.workers(PREFILL)
        assert (p.grpc_addr, p.bootstrap_addr, p.model, p.max_context_len) == (p0.addr, p0.addr, "tiny", 256)
        assert {"labelSelector": [SELECTOR]}.items() <= {k: v for k, v in kube.requests[0].items()}.items()

        # A pod becomes ready (watch: MODIFIED).
        s["decode"]["endpoints"][1]["conditions"]["ready"] = True
        kube.put(s["decode"])
        await wait_until(lambda: len(registry.workers(DECODE)) == 2)
        # Another turns unready (failed readiness probe or draining).
        s["decode"]["endpoints"][0]["conditions"]["ready"] = False
        kube.put(s["decode"])
        await wait_until(lambda: ids(registry, DECODE) == [("decode-c", "uid-c", 31)])

        # Load reaches the router by polling the workers.
        d1.running = 5
        await wait_until(lambda: registry.workers(DECODE)[0].load.running == 5)

        # The prefill pod is replaced: same address, new pod UID and a new process.
        await p0.stop()
        s["prefill"]["endpoints"] = []
        kube.put(s["prefill"])
        await wait_until(lambda: registry.workers(PREFILL) == [])
        p1 = await FakeWorker("127.0.0.2", port, PREFILL, "prefill-a", "uid-a2", 12).start()
        s["prefill"]["endpoints"] = [endpoint("127.0.0.2", "uid-a2", "prefill-a")]
        kube.put(s["prefill"])
        await wait_until(lambda: ids(registry, PREFILL) == [("prefill-a", "uid-a2", 12)])

        # A container restarted in place: same pod UID and address, new boot epoch (seen by polling).
        await p1.stop()
        p2 = await FakeWorker("127.0.0.2", port, PREFILL, "prefill-a", "uid-a2", 13).start()
        await wait_until(lambda: ids(registry, PREFILL) == [("prefill-a", "uid-a2", 13)])

        # An endpoint naming a pod that is not the one answering at that address is not used.
        s["decode"]["endpoints"] = [endpoint("127.0.0.4", "uid-someone-else", "decode-c")]
        kube.put(s["decode"])
        await wait_until(lambda: registry.workers(DECODE) == [])

        # The whole slice disappears.
        kube.delete(s["prefill"]["metadata"]["name"])
        await wait_until(lambda: registry.workers(PREFILL) == [])
        assert changes[0] == ["decode-b", "prefill-a"] and changes[-1] == []
        await registry.close()
        await registry.close()  # safe twice
        for w in (p2, d0, d1):
            await w.stop()

    arun(body(), timeout=30)


def test_an_expired_watch_lists_again_and_misses_nothing(kube):
    async def body():
        port = free_port()
        s = slices(port)
        p0 = await FakeWorker("127.0.0.2", port, PREFILL, "prefill-a", "uid-a", 1).start()
        kube.put(s["prefill"])
        registry = KubernetesRegistry(namespace="tandem", selector=SELECTOR, api_server=kube.url,
                                      info_poll_s=0.1, watch_timeout_s=2, retry_s=0.05)
        await registry.start()
        assert registry.workers(PREFILL) == []
        lists = kube.lists()
        kube.expire_watches()
        s["prefill"]["endpoints"] = [endpoint("127.0.0.2", "uid-a", "prefill-a")]
        kube.put(s["prefill"])
        await wait_until(lambda: ids(registry, PREFILL) == [("prefill-a", "uid-a", 1)])
        assert kube.lists() > lists  # the 410 made it list again
        await registry.close()
        await p0.stop()

    arun(body(), timeout=30)


def test_router_with_k8s_discovery_serves_once_both_roles_are_ready(kube):
    async def body():
        port = free_port()
        s = slices(port)
        p0 = await FakeWorker("127.0.0.2", port, PREFILL, "prefill-a", "uid-a", 1).start()
        d0 = await FakeWorker("127.0.0.3", port, DECODE, "decode-b", "uid-b", 2).start()
        s["prefill"]["endpoints"] = [endpoint("127.0.0.2", "uid-a", "prefill-a")]
        kube.put(s["prefill"])
        kube.put(s["decode"])
        config = RouterConfig(port=0, discovery="k8s", k8s_namespace="tandem", k8s_api_server=kube.url)
        config.validate()
        router = RouterServer(config)
        assert isinstance(router.registry, KubernetesRegistry)
        await router.start()
        assert not router.can_route()  # no decode worker yet
        s["decode"]["endpoints"] = [endpoint("127.0.0.3", "uid-b", "decode-b")]
        kube.put(s["decode"])
        await wait_until(router.can_route, timeout=5)
        await router.stop(0)
        await p0.stop()
        await d0.stop()

    arun(body(), timeout=30)


def test_router_config_for_k8s_discovery():
    RouterConfig(discovery="k8s").validate()
    with pytest.raises(ValueError, match="takes no"):
        RouterConfig(discovery="k8s", redis_url="redis://x").validate()
    with pytest.raises(ValueError, match="needs --redis-url"):
        RouterConfig(discovery="redis").validate()
    assert RouterConfig(redis_url="redis://x").discovery_kind == "redis"

