"""The planner's Kubernetes actuator against a fake API server over real HTTP on 127.0.0.1: it serves
`apps/v1 .../deployments/NAME/scale` (GET and merge PATCH) the way kube-apiserver does, and answers
403 / 404 Status objects where a test says so."""

from __future__ import annotations

import argparse
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tandem.services.planner.k8s import FIELD_MANAGER, MERGE_PATCH, KubernetesActuator
from tandem.services.planner.k8s_config import KubernetesTarget, add_k8s_arguments, k8s_target_from_args
from tandem.services.planner.shape import Shape
from tests.services.common.fake_kube_api import FakeKubeAPI

NS = "tandem"
SCALE = f"/apis/apps/v1/namespaces/{NS}/deployments/{{}}/scale"


class FakeScaleAPI:
    """Deployments by name: spec and observed replicas. `forbid` / `missing`: names answered 403 / 404."""

    def __init__(self, replicas: dict[str, int]):
        self.spec = dict(replicas)
        self.status = dict(replicas)
        self.forbid: set[str] = set()
        self.forbid_patch: set[str] = set()
        self.requests: list[tuple[str, str, str, dict | None]] = []   # method, path+query, content type, body
        self.lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                api._handle(self, None)

            def do_PATCH(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                api._handle(self, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def patches(self) -> list[tuple[str, str, dict]]:
        return [(path, ctype, body) for method, path, ctype, body in self.requests if method == "PATCH"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handle(self, h: BaseHTTPRequestHandler, body: dict | None) -> None:
        path, _, _ = h.path.partition("?")
        with self.lock:
            self.requests.append((h.command, h.path, h.headers.get("Content-Type", ""), body))
            name = next((n for n in self.spec if SCALE.format(n) == path), None)
            if name is None:
                return self._status(h, 404, "NotFound", f'deployments.apps "{path.split("/")[-2]}" not found')
            if name in self.forbid or (body is not None and name in self.forbid_patch):
                return self._status(h, 403, "Forbidden", f'deployments.apps "{name}" is forbidden: User '
                                    f'"system:serviceaccount:{NS}:tandem-planner" cannot get resource '
                                    f'"deployments/scale" in API group "apps" in the namespace "{NS}"')
            if body is not None:
                self.spec[name] = body["spec"]["replicas"]
            self._json(h, 200, {
                "kind": "Scale", "apiVersion": "autoscaling/v1",
                "metadata": {"name": name, "namespace": NS, "resourceVersion": str(len(self.requests))},
                "spec": {"replicas": self.spec[name]},
                "status": {"replicas": self.status[name],
                           "selector": f"app.kubernetes.io/name=tandem,tandem.ai/role={name.split('-')[-1]}"}})

    def _status(self, h, code: int, reason: str, message: str) -> None:
        self._json(h, code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                             "message": message, "reason": reason, "code": code})

    _json = staticmethod(FakeKubeAPI._json)   # the discovery tests' fake API server answers the same way


@pytest.fixture
def kube():
    api = FakeScaleAPI({"tandem-prefill": 1, "tandem-decode": 1})
    yield api
    api.close()


def actuator(url: str, **kw) -> KubernetesActuator:
    return KubernetesActuator.from_config(KubernetesTarget(namespace=NS, api_server=url, request_timeout_s=2, **kw))


def test_current_is_the_two_scales_spec(kube):
    kube.spec.update({"tandem-prefill": 2, "tandem-decode": 3})
    a = actuator(kube.url)
    assert a.current() == Shape(2, 3)
    assert [(m, p.partition("?")[0]) for m, p, _, _ in kube.requests] == [
        ("GET", SCALE.format("tandem-prefill")), ("GET", SCALE.format("tandem-decode"))]


def test_apply_patches_exactly_the_two_scale_subresources(kube):
    a = actuator(kube.url)
    a.apply(Shape(2, 3), "long prompts")
    patches = kube.patches()
    assert [(p.partition("?")[0], body) for p, _, body in patches] == [
        (SCALE.format("tandem-prefill"), {"spec": {"replicas": 2}}),
        (SCALE.format("tandem-decode"), {"spec": {"replicas": 3}})]
    assert all(ctype == MERGE_PATCH and f"fieldManager={FIELD_MANAGER}" in p for p, ctype, _ in patches)
    assert kube.spec == {"tandem-prefill": 2, "tandem-decode": 3}
    assert a.current() == Shape(2, 3)


def test_apply_grows_first_and_leaves_an_unchanged_deployment_alone(kube):
    kube.spec.update({"tandem-prefill": 2, "tandem-decode": 1})
    kube.status.update(kube.spec)
    a = actuator(kube.url)
    a.apply(Shape(1, 2), "long outputs")
    assert [(p.partition("?")[0], b["spec"]["replicas"]) for p, _, b in kube.patches()] == [
        (SCALE.format("tandem-decode"), 2), (SCALE.format("tandem-prefill"), 1)]
    del kube.requests[:]
    a.apply(Shape(1, 2), "same again")
    assert kube.patches() == [] and len(kube.requests) == 2      # read both, patched nothing


def test_busy_while_a_deployment_is_rolling(kube):
    a = actuator(kube.url)
    assert not a.busy()
    a.apply(Shape(1, 2), "more decode")
    assert a.busy()                                   # spec 2, one decode pod observed
    kube.status["tandem-decode"] = 2
    assert not a.busy()
    a.apply(Shape(1, 1), "less decode")
    assert a.busy()                                   # the leaving pod still counted: it drains
    kube.status["tandem-decode"] = 1
    assert not a.busy() and a.current() == Shape(1, 1)


def test_a_colocated_shape_scales_prefill_to_zero_after_decode_grew(kube):
    a = actuator(kube.url)
    a.apply(Shape(0, 2), "low load")
    assert [(p.partition("?")[0], b["spec"]["replicas"]) for p, _, b in kube.patches()] == [
        (SCALE.format("tandem-decode"), 2), (SCALE.format("tandem-prefill"), 0)]
    kube.status.update(kube.spec)
    assert a.current() == Shape(0, 2) and not a.busy()


def test_no_decode_replica_is_no_shape(kube, caplog):
    kube.spec["tandem-decode"] = 0
    a = actuator(kube.url)
    with caplog.at_level(logging.INFO, "tandem.services.planner.k8s"):
        for _ in range(3):
            assert a.current() is None and a.busy()       # spec 0, one pod still observed
    assert "no shape without a decode worker" in a.problem
    assert [r.levelno for r in caplog.records] == [logging.WARNING]    # said once, not every interval


def test_forbidden_is_logged_once_and_the_planner_goes_on(kube, caplog):
    kube.forbid.add("tandem-decode")
    a = actuator(kube.url)
    with caplog.at_level(logging.INFO, "tandem.services.planner.k8s"):
        for _ in range(3):
            assert a.current() is None and a.busy() is False
            a.apply(Shape(2, 2), "burst")
    assert kube.spec == {"tandem-prefill": 1, "tandem-decode": 1} and kube.patches() == []
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "403 Forbidden" in warnings[0].getMessage()
    assert "deployments/scale of tandem-prefill and tandem-decode in namespace tandem" in a.problem
    kube.forbid.clear()                               # RBAC fixed: the next interval works
    with caplog.at_level(logging.INFO, "tandem.services.planner.k8s"):
        assert a.current() == Shape(1, 1) and a.problem is None
    assert "works again" in caplog.records[-1].getMessage()


def test_a_missing_deployment_is_404_with_the_flags_to_fix(kube):
    a = actuator(kube.url, decode_deployment="tandem-decoder")
    assert a.current() is None and not a.busy()
    a.apply(Shape(1, 2), "x")
    assert "404 Not Found" in a.problem and "--decode-deployment" in a.problem
    assert kube.patches() == []


def test_a_partly_failed_apply_leaves_the_rest_to_the_next_interval(kube):
    a = actuator(kube.url)
    kube.forbid_patch.add("tandem-decode")
    a.apply(Shape(2, 2), "burst")
    assert kube.spec == {"tandem-prefill": 2, "tandem-decode": 1} and "403" in a.problem
    kube.forbid_patch.clear()
    del kube.requests[:]
    assert a.current() == Shape(2, 1)                 # the planner sees it is not there yet, and applies again
    a.apply(Shape(2, 2), "burst")
    assert [p.partition("?")[0] for p, _, _ in kube.patches()] == [SCALE.format("tandem-decode")]
    assert kube.spec == {"tandem-prefill": 2, "tandem-decode": 2} and a.problem is None


def test_the_api_server_down_is_not_a_crash(kube):
    url = kube.url
    kube.close()
    a = actuator(url)
    assert a.current() is None and a.busy() is False
    a.apply(Shape(1, 2), "x")
    assert "does not answer" in a.problem


def test_flags_build_the_target(monkeypatch, tmp_path):
    p = argparse.ArgumentParser()
    add_k8s_arguments(p)
    t = k8s_target_from_args(p.parse_args([]))
    assert t == KubernetesTarget()
    t = k8s_target_from_args(p.parse_args(["--deployments-namespace", "llm", "--prefill-deployment", "p",
                                           "--decode-deployment", "d", "--kube-api-server", "http://x:8001"]))
    assert (t.namespace, t.prefill_deployment, t.decode_deployment, t.api_server) == ("llm", "p", "d", "http://x:8001")
    with pytest.raises(ValueError, match="one Deployment"):
        k8s_target_from_args(p.parse_args(["--prefill-deployment", "x", "--decode-deployment", "x"]))
    # No namespace given: the pod's (its service-account mount), "default" outside a cluster.
    import tandem.services.planner.k8s as k8s
    from tandem.services.common.k8s_registry import pod_namespace

    ns_file = tmp_path / "namespace"
    ns_file.write_text("serving\n")
    monkeypatch.setattr(k8s, "pod_namespace", lambda: pod_namespace(str(ns_file)))
    assert KubernetesActuator.from_config(KubernetesTarget()).target.namespace == "serving"
