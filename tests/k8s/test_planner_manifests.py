"""The planner on Kubernetes (k8s/components/planner): its RBAC is exactly get and patch of the two
worker Deployments' scale, it is the only controller of their replicas, and k8s-check catches each
way of breaking that in the rendered overlays."""

from __future__ import annotations

import shutil

import pytest
import yaml

from tests.k8s.check import ROOT, check, invariants, planner_problems
from tests.k8s.render import RenderError, render

K8S = ROOT / "k8s"
PLANNER = K8S / "overlays" / "planner"


def by_name(objs, kind, name):
    [o] = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return o


def planner_role(objs):
    return by_name(objs, "Role", "tandem-planner-scale")


@pytest.fixture
def objs():
    return render(PLANNER)


def test_the_planner_may_get_and_patch_only_its_two_deployments_scale(objs):
    assert planner_role(objs)["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments/scale"],
                                            "resourceNames": ["tandem-prefill", "tandem-decode"],
                                            "verbs": ["get", "patch"]}]
    [binding] = [b for b in objs if b["kind"] in ("RoleBinding", "ClusterRoleBinding")
                 and any(s["name"] == "tandem-planner" for s in b["subjects"])]
    assert binding["kind"] == "RoleBinding" and binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tandem-planner-scale"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tandem-planner", "namespace": "tandem"}]
    pod = by_name(objs, "Deployment", "tandem-planner")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "tandem-planner" and pod["automountServiceAccountToken"] is True
    assert planner_problems(objs) == [] and invariants(objs) == []


def test_the_overlay_replaces_the_workers_hpas_and_keeps_the_others(objs):
    hpas = {h["spec"]["scaleTargetRef"]["name"] for h in objs if h["kind"] == "HorizontalPodAutoscaler"}
    assert hpas == {"tandem-router", "tandem-gateway"}
    assert "replicas" not in by_name(objs, "Deployment", "tandem-prefill")["spec"]
    assert "replicas" not in by_name(objs, "Deployment", "tandem-decode")["spec"]
    d = by_name(objs, "Deployment", "tandem-planner")
    assert d["spec"]["replicas"] == 1 and d["spec"]["strategy"] == {"type": "Recreate"}
    [c] = d["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "tandem:dev" and c["imagePullPolicy"] == "IfNotPresent"
    assert c["args"][1:3] == ["planner", "--planner-target=kubernetes"]
    assert "--host=0.0.0.0" in c["args"] and "--metrics-port=9090" in c["args"]   # probed from the kubelet
    assert all(o["metadata"].get("namespace") == "tandem" for o in objs if o["kind"] != "Namespace")
    # The planner reaches the router's metrics port through the default-deny ingress.
    np = by_name(objs, "NetworkPolicy", "tandem-metrics-from-planner")
    assert np["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"tandem.ai/role": "planner"}}}],
                                      "ports": [{"port": 9090, "protocol": "TCP"}]}]


@pytest.mark.parametrize("edit, expect", [
    (lambda r: r["rules"][0]["verbs"].append("update"), "rules"),
    (lambda r: r["rules"][0]["verbs"].remove("get"), "rules"),
    (lambda r: r["rules"][0]["resources"].append("deployments"), "rules"),
    (lambda r: r["rules"][0].update(resources=["*"]), "rules"),
    (lambda r: r["rules"][0].pop("resourceNames"), "rules"),
    (lambda r: r["rules"][0]["resourceNames"].append("tandem-router"), "rules"),
    (lambda r: r["rules"][0].update(apiGroups=["*"]), "rules"),
    (lambda r: r["rules"].append({"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}), "rules"),
])
def test_any_other_permission_of_the_planner_fails(objs, edit, expect):
    edit(planner_role(objs))
    problems = planner_problems(objs)
    assert any(p.startswith("Role/tandem-planner-scale (bound to the planner): " + expect) for p in problems)


def test_a_second_binding_or_a_cluster_role_fails(objs):
    objs.append({"kind": "ClusterRoleBinding", "metadata": {"name": "planner-view"},
                 "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"},
                 "subjects": [{"kind": "ServiceAccount", "name": "tandem-planner", "namespace": "tandem"}]})
    assert any("needs exactly one RoleBinding to a Role" in p for p in planner_problems(objs))


def test_the_planners_role_bound_to_someone_else_fails(objs):
    by_name(objs, "RoleBinding", "tandem-planner-scale")["subjects"].append(
        {"kind": "ServiceAccount", "name": "tandem-router", "namespace": "tandem"})
    assert any("binds the planner's Role to others too" in p for p in planner_problems(objs))


def test_only_the_planner_may_touch_deployments(objs):
    by_name(objs, "Role", "tandem-router-discovery")["rules"].append(
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["patch"]})
    assert any(p.startswith("Role/tandem-router-discovery: grants ['patch']") for p in planner_problems(objs))


def test_flags_and_role_must_name_the_worker_deployments(objs):
    c = by_name(objs, "Deployment", "tandem-planner")["spec"]["template"]["spec"]["containers"][0]
    c["args"] = [a.replace("=tandem-decode", "=tandem-decoder") for a in c["args"]]
    problems = planner_problems(objs)
    assert any("scales ['tandem-prefill', 'tandem-decoder'], but the worker Deployments are" in p for p in problems)
    assert any("(bound to the planner): rules" in p for p in problems)   # the Role names tandem-decode


def test_two_planners_fail(objs):
    by_name(objs, "Deployment", "tandem-planner")["spec"]["strategy"] = {"type": "RollingUpdate"}
    assert any("strategy Recreate" in p for p in planner_problems(objs))


def test_the_planner_and_an_hpa_on_one_deployment_flap(objs):
    base = render(K8S / "overlays" / "cpu-dev")
    objs.append(by_name(base, "HorizontalPodAutoscaler", "tandem-decode"))
    assert any(p.startswith("Deployment/tandem-decode: scaled by the planner and by HorizontalPodAutoscaler/"
                            "tandem-decode") for p in invariants(objs))


def test_the_component_composes_with_the_gpu_overlay(tmp_path):
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s)
    k = k8s / "overlays" / "gpu-rdma" / "kustomization.yaml"
    doc = yaml.safe_load(k.read_text())
    doc["components"] = ["../../components/planner"]
    k.write_text(yaml.safe_dump(doc))
    objs = render(k.parent)
    assert by_name(objs, "Deployment", "tandem-planner")["spec"]["template"]["spec"]["containers"][0]["image"] \
        == "ghcr.io/tandem-ai/tandem:0.1.0"
    assert invariants(objs) == []
    assert check(k8s, run_checkov=False)["gpu-rdma"] == []


def test_a_component_must_be_a_component(tmp_path):
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s)
    k = k8s / "components" / "planner" / "kustomization.yaml"
    k.write_text(k.read_text().replace("kind: Component", "kind: Kustomization"))
    with pytest.raises(RenderError, match="accumulating components"):
        render(k8s / "overlays" / "planner")


def test_a_drain_longer_than_the_grace_period_fails_through_the_configmap():
    objs = render(K8S / "overlays" / "cpu-dev")
    by_name(objs, "ConfigMap", "tandem-config")["data"]["DRAIN_TIMEOUT"] = "58"
    problems = invariants(objs)
    assert "Deployment/tandem-prefill container prefill: terminationGracePeriodSeconds 60 leaves no room for " \
           "--drain-timeout 58.0" in problems
    assert any(p.startswith("Deployment/tandem-decode container decode: terminationGracePeriodSeconds") for p in problems)


def test_the_planner_may_not_go_below_the_routers_prefill_minimum(objs):
    c = by_name(objs, "Deployment", "tandem-planner")["spec"]["template"]["spec"]["containers"][0]
    c["args"] = [a for a in c["args"] if not a.startswith("--planner-min-prefill")]
    assert any("--planner-min-prefill 0 is below the router's --min-prefill-workers 1" in p
               for p in planner_problems(objs))
    router = by_name(objs, "Deployment", "tandem-router")["spec"]["template"]["spec"]["containers"][0]
    router["args"].append("--min-prefill-workers=0")                # the router serves 0PnD: so may the planner
    assert planner_problems(objs) == []


def test_the_planner_pod_command_line_parses_into_a_kubernetes_target(objs):
    pytest.importorskip("tandem.cli.planner_cmd")
    from tandem.cli.main import build_parser
    from tandem.services.planner.config import PlannerConfig

    [c] = by_name(objs, "Deployment", "tandem-planner")["spec"]["template"]["spec"]["containers"]
    cfg = PlannerConfig.from_args(build_parser().parse_args(c["args"]))
    assert (cfg.target, cfg.host, cfg.metrics_port, cfg.min_prefill) == ("kubernetes", "0.0.0.0", 9090, 1)
    assert (cfg.k8s.prefill_deployment, cfg.k8s.decode_deployment, cfg.k8s.namespace) == \
        ("tandem-prefill", "tandem-decode", "")          # "": the pod's namespace
    assert cfg.router_metrics_url == "http://tandem-router:9090/metrics"
