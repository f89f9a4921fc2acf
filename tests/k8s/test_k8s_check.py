"""`make k8s-check` passes on k8s/ as committed, and fails on manifests broken on purpose."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.k8s.check import ROOT, check, invariants, schema_problems
from tests.k8s.render import kubectls, render

K8S = ROOT / "k8s"


def by_name(objs, kind, name):
    [o] = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return o


@pytest.fixture
def k8s_copy(tmp_path) -> Path:
    dst = tmp_path / "k8s"
    shutil.copytree(K8S, dst)
    return dst


def edit(path: Path, fn) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for d in docs:
        fn(d)
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))


def test_every_overlay_passes_schemas_invariants_and_checkov():
    assert check(K8S) == {"cpu-dev": [], "gpu-rdma": [], "planner": []}


def test_the_renderer_resolves_the_overlays():
    dev = render(K8S / "overlays" / "cpu-dev")
    assert {o["metadata"].get("namespace") for o in dev if o["kind"] != "Namespace"} == {"tandem"}
    prefill = by_name(dev, "Deployment", "tandem-prefill")["spec"]["template"]["spec"]["containers"][0]
    assert prefill["image"] == "tandem:dev" and prefill["imagePullPolicy"] == "IfNotPresent"
    assert prefill["resources"]["limits"] == {"cpu": "2", "memory": "4Gi"}
    assert by_name(dev, "Deployment", "tandem-router")["spec"]["replicas"] == 1
    assert by_name(dev, "ConfigMap", "tandem-config")["data"]["MAX_TOTAL_TOKENS"] == "16384"
    assert by_name(dev, "RoleBinding", "tandem-router-discovery")["subjects"][0]["namespace"] == "tandem"

    gpu = render(K8S / "overlays" / "gpu-rdma")
    pod = by_name(gpu, "Deployment", "tandem-decode")["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert c["image"] == "ghcr.io/tandem-ai/tandem:0.1.0"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and "--require-rdma" in c["args"]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True          # kept from the base
    assert sorted(m["mountPath"] for m in c["volumeMounts"]) == ["/cache", "/dev/shm", "/etc/tandem/internal", "/tmp"]
    assert sorted(v["name"] for v in pod["volumes"]) == ["cache", "dshm", "internal-token", "tmp"]
    router = by_name(gpu, "Deployment", "tandem-router")["spec"]["template"]["spec"]["containers"][0]
    assert "capabilities" not in router["securityContext"] or "add" not in router["securityContext"]["capabilities"]


def test_a_misspelt_field_fails_the_strict_schema(k8s_copy):
    def misspell(d):
        if d["kind"] == "Deployment":
            d["spec"]["replica"] = d["spec"].pop("replicas")
    edit(k8s_copy / "base" / "router.yaml", misspell)
    problems = check(k8s_copy, run_checkov=False)
    assert any("Deployment/tandem-router: schema" in p and "replica" in p for p in problems["cpu-dev"])


def test_a_wrong_type_fails_the_schema():
    objs = render(K8S / "overlays" / "cpu-dev")
    d = by_name(objs, "Deployment", "tandem-decode")
    d["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc"
    assert any("tandem-decode" in p for p in schema_problems(objs))


def test_a_missing_readiness_probe_fails_the_invariants_and_checkov(k8s_copy):
    def drop_probe(d):
        if d["kind"] == "Deployment":
            del d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    edit(k8s_copy / "base" / "decode.yaml", drop_probe)
    problems = check(k8s_copy)["gpu-rdma"]
    assert "Deployment/tandem-decode container decode: no readinessProbe" in problems
    assert any("tandem-decode: checkov CKV_K8S_9" in p for p in problems)


def test_capabilities_pdbs_and_skips_are_policed(k8s_copy):
    objs = render(K8S / "overlays" / "cpu-dev")
    router = by_name(objs, "Deployment", "tandem-router")
    router["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"] = ["IPC_LOCK"]
    objs = [o for o in objs if not (o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] == "tandem-prefill")]
    problems = invariants(objs)
    assert any("tandem-router container router: adds capabilities ['IPC_LOCK']" in p for p in problems)
    assert "Deployment/tandem-prefill: no PodDisruptionBudget selects its pods" in problems

    (k8s_copy / "overlays" / "cpu-dev" / "checkov-skips.yaml").write_text("CKV_K8S_9: ''\n")
    assert any("skip of CKV_K8S_9 has no reason" in p for p in check(k8s_copy)["cpu-dev"])


def test_every_kubectl_renders_and_a_patch_without_a_target_fails(k8s_copy):
    assert len(kubectls()) >= 2 and len({k.version.split(".")[1] for k in kubectls()}) >= 2   # two minors
    # What kustomize v5.8 refused in the planner overlay: a patch whose target only a component adds, in
    # its namespace, named without it (the project's own renderer had accepted it).
    patch = k8s_copy / "overlays" / "planner" / "planner-dev.yaml"
    patch.write_text("\n".join(line for line in patch.read_text().splitlines() if "namespace:" not in line))
    problems = check(k8s_copy, run_checkov=False)["planner"]
    assert len(problems) == len(kubectls())
    assert all(p.startswith("render: kubectl v1.") and "no resource matches strategic merge patch" in p
               for p in problems)


def test_a_delete_patch_is_refused(k8s_copy):
    # Older kustomize (kubectl 1.32's v5.5.0) panics on `$patch: delete` in a component: k8s/ does without.
    (k8s_copy / "components" / "planner" / "gone.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: tandem-config\n$patch: delete\n")
    problems = check(k8s_copy, run_checkov=False)
    assert all(any("gone.yaml" in p and "$patch: delete" in p for p in problems[o]) for o in problems)


def test_every_service_must_read_the_internal_secret_from_a_mounted_secret():
    objs = render(K8S / "overlays" / "gpu-rdma")
    decode = by_name(objs, "Deployment", "tandem-decode")["spec"]["template"]["spec"]
    decode["containers"][0]["args"] = [a for a in decode["containers"][0]["args"]
                                       if not a.startswith("--internal-token-file")]
    router = by_name(objs, "Deployment", "tandem-router")["spec"]["template"]["spec"]
    router["volumes"] = [v for v in router["volumes"] if "secret" not in v]
    problems = invariants(objs)
    assert any("tandem-decode container decode: no --internal-token-file" in p for p in problems)
    assert any("tandem-router container router: --internal-token-file /etc/tandem/internal/token is not in a "
               "mounted Secret volume" in p for p in problems)
    assert len([p for p in problems if "internal" in p]) == 2
