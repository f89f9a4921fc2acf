"""`make k8s-check`: render every overlay of k8s/ with the real kubectl/kustomize and check each object
three ways.

0. Rendering: `kubectl kustomize` of every kubectl in .venv/tools (tests/k8s/render.py: the newest
   minor and the one before); each must render, and all must render the same objects.

1. Schema: `kubernetes-validate --strict` against the OpenAPI schemas of KUBERNETES_VERSION (unknown
   or misspelt fields fail).
2. Tandem's own invariants (`invariants`): every role has a Deployment with probes, resources, a
   locked-down securityContext and a drain-sized grace period, a PodDisruptionBudget, and exactly one
   controller of its replicas: an HPA, or for the workers the SLO planner (k8s/components/planner),
   whose RBAC is exactly get and patch of its two Deployments' scale (`planner_problems`).
3. Security posture: checkov on the rendered manifests, zero failures; each skipped check has a
   written reason (k8s/checkov-skips.yaml, an overlay's checkov-skips.yaml, or a resource's
   `checkov.io/skipN: ID=reason` annotation).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from tests.k8s.render import RenderError, kubectls, render_text

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_VERSION = "1.33.0"
ROLES = ("gateway", "router", "prefill", "decode")
WORKERS = ("prefill", "decode")
PLANNER = "planner"
PLANNER_VERBS = ["get", "patch"]
DEFAULT_CHECKOV = ROOT / ".venv" / "tools" / "checkov" / "bin" / "checkov"


def overlays(k8s: Path) -> list[Path]:
    return sorted(p for p in (k8s / "overlays").iterdir() if (p / "kustomization.yaml").is_file())


def schema_problems(objs: list[dict]) -> list[str]:
    import kubernetes_validate

    out = []
    for o in objs:
        try:
            kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            out.append(f"{_name(o)}: schema: {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError:
            out.append(f"{_name(o)}: schema: no schema for {o.get('apiVersion')} {o.get('kind')}")
    return out


def invariants(objs: list[dict]) -> list[str]:
    out = []
    by_kind: dict[str, list[dict]] = {}
    for o in objs:
        by_kind.setdefault(o["kind"], []).append(o)
    deployments = {_role(d): d for d in by_kind.get("Deployment", [])}
    configmaps = {c["metadata"]["name"]: c.get("data") or {} for c in by_kind.get("ConfigMap", [])}
    scaled_by_planner = set(_planner_scales(by_kind))
    for role in ROLES:
        d = deployments.get(role)
        if d is None:
            out.append(f"no Deployment labelled tandem.ai/role={role}")
            continue
        out += _deployment_problems(d, role, configmaps)
        if not any(_selects(p["spec"].get("selector"), d) for p in by_kind.get("PodDisruptionBudget", [])):
            out.append(f"{_name(d)}: no PodDisruptionBudget selects its pods")
        hpas = [h for h in by_kind.get("HorizontalPodAutoscaler", [])
                if h["spec"]["scaleTargetRef"]["name"] == d["metadata"]["name"]]
        planned = d["metadata"]["name"] in scaled_by_planner
        if planned and hpas:
            out.append(f"{_name(d)}: scaled by the planner and by {_name(hpas[0])}: two controllers writing one "
                       "replicas field flap (k8s/components/planner deletes the workers' HPAs)")
        elif not planned and not hpas:
            out.append(f"{_name(d)}: no HorizontalPodAutoscaler")
        elif planned and role not in WORKERS:
            out.append(f"{_name(d)}: the planner scales only the prefill and decode workers")
    if PLANNER in deployments or scaled_by_planner:
        out += planner_problems(objs)
    for role in WORKERS:
        svcs = [s for s in by_kind.get("Service", []) if (s["metadata"].get("labels") or {}).get("tandem.ai/role") == role]
        if not svcs or any(s["spec"].get("clusterIP") != "None" for s in svcs):
            out.append(f"the {role} workers need a headless Service labelled tandem.ai/role={role}")
    if not by_kind.get("NetworkPolicy"):
        out.append("no NetworkPolicy")
    return out


def _deployment_problems(d: dict, role: str, configmaps: dict[str, dict] | None = None) -> list[str]:
    out = []
    pod = d["spec"]["template"]["spec"]
    psc = pod.get("securityContext") or {}
    if not psc.get("runAsNonRoot"):
        out.append(f"{_name(d)}: pod securityContext.runAsNonRoot is not true")
    grace = pod.get("terminationGracePeriodSeconds", 30)
    for c in pod["containers"]:
        where = f"{_name(d)} container {c['name']}"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe not in c:
                out.append(f"{where}: no {probe}")
        grpc_probe = any("grpc" in (c.get(p) or {}) for p in ("readinessProbe", "livenessProbe"))
        if role not in ("gateway", PLANNER) and not grpc_probe:   # both serve HTTP only
            out.append(f"{where}: a gRPC service is probed with gRPC health")
        res = c.get("resources") or {}
        for kind in ("requests", "limits"):
            if not {"cpu", "memory"} <= set(res.get(kind) or {}):
                out.append(f"{where}: resources.{kind} must set cpu and memory")
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False or sc.get("readOnlyRootFilesystem") is not True:
            out.append(f"{where}: needs allowPrivilegeEscalation: false and readOnlyRootFilesystem: true")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or ()):
            out.append(f"{where}: capabilities must drop ALL")
        added = set(caps.get("add") or ())
        if added - {"IPC_LOCK"} or (added and role not in WORKERS):
            out.append(f"{where}: adds capabilities {sorted(added)} (only IPC_LOCK, only on RDMA workers)")
        if role == PLANNER:   # no gRPC, nothing to drain, no internal secret: it only reads /metrics
            continue
        if not ((c.get("lifecycle") or {}).get("preStop")):
            out.append(f"{where}: no preStop hook")
        out += _secret_problems(pod, c, where)
        drain = _flag(c, "--drain-timeout", _container_vars(c, configmaps or {}))
        if drain is not None and drain + 5 >= grace:
            out.append(f"{where}: terminationGracePeriodSeconds {grace} leaves no room for --drain-timeout {drain}")
    return out


def _planner_sa(by_kind: dict[str, list[dict]]) -> tuple[str, str] | None:
    """(namespace, name) of the planner pods' ServiceAccount; None without a planner Deployment."""
    for d in by_kind.get("Deployment", []):
        if _role(d) == PLANNER:
            pod = d["spec"]["template"]["spec"]
            return d["metadata"].get("namespace", ""), pod.get("serviceAccountName", "default")
    return None


def _grants(by_kind: dict[str, list[dict]], sa: tuple[str, str]) -> list[tuple[dict, dict]]:
    """(binding, role) for every RoleBinding / ClusterRoleBinding that names the ServiceAccount `sa`."""
    out = []
    for kind in ("RoleBinding", "ClusterRoleBinding"):
        for b in by_kind.get(kind, []):
            if any(x.get("kind") == "ServiceAccount" and (x.get("namespace", ""), x["name"]) == sa
                   for x in b.get("subjects") or ()):
                ref = b["roleRef"]
                roles = [r for r in by_kind.get(ref["kind"], []) if r["metadata"]["name"] == ref["name"]]
                out.append((b, roles[0] if roles else {"kind": ref["kind"], "metadata": {"name": ref["name"]}}))
    return out


def _planner_scales(by_kind: dict[str, list[dict]]) -> list[str]:
    """The Deployments whose scale the planner's ServiceAccount may patch (all of them: ["*"])."""
    sa = _planner_sa(by_kind)
    names: list[str] = []
    for _, role in _grants(by_kind, sa) if sa else ():
        for rule in role.get("rules") or ():
            if {"deployments/scale", "*"} & set(rule.get("resources") or ()) and \
                    {"patch", "update", "*"} & set(rule.get("verbs") or ()):
                names += rule.get("resourceNames") or [d["metadata"]["name"] for d in by_kind.get("Deployment", [])]
    return names


def planner_problems(objs: list[dict]) -> list[str]:
    """The planner is one pod whose only permission is get and patch of deployments/scale of the prefill
    and decode Deployments it is told to scale, by name (docs/planner.md, "On Kubernetes")."""
    from tandem.services.planner.k8s_config import KubernetesTarget

    by_kind: dict[str, list[dict]] = {}
    for o in objs:
        by_kind.setdefault(o["kind"], []).append(o)
    planners = [d for d in by_kind.get("Deployment", []) if _role(d) == PLANNER]
    if len(planners) != 1:
        return [f"{len(planners)} Deployments labelled tandem.ai/role={PLANNER}: exactly one planner writes replicas"]
    [d] = planners
    out = _deployment_problems(d, PLANNER)
    if d["spec"].get("replicas", 1) != 1 or (d["spec"].get("strategy") or {}).get("type") != "Recreate":
        out.append(f"{_name(d)}: needs replicas 1 and strategy Recreate (two planners would both scale)")
    [c] = d["spec"]["template"]["spec"]["containers"]
    default = KubernetesTarget()
    targets = [_arg(c, "--prefill-deployment") or default.prefill_deployment,
               _arg(c, "--decode-deployment") or default.decode_deployment]
    workers = {_role(w): w["metadata"]["name"] for w in by_kind.get("Deployment", []) if _role(w) in WORKERS}
    if targets != [workers.get("prefill"), workers.get("decode")]:
        out.append(f"{_name(d)}: scales {targets}, but the worker Deployments are "
                   f"{[workers.get('prefill'), workers.get('decode')]}")
    routers = [r for r in by_kind.get("Deployment", []) if _role(r) == "router"]
    mins = [_flag(r["spec"]["template"]["spec"]["containers"][0], "--min-prefill-workers") for r in routers]
    router_min = max((1 if m is None else m for m in mins), default=1)     # None: the router's default, 1
    planner_min = _flag(c, "--planner-min-prefill") or 0           # the planner's default: 0P allowed
    if planner_min < router_min:
        out.append(f"{_name(d)}: --planner-min-prefill {planner_min:g} is below the router's --min-prefill-workers "
                   f"{router_min:g}: a shape with fewer prefill pods would leave the router NOT_SERVING")
    sa = _planner_sa(by_kind)
    if not any(a["metadata"]["name"] == sa[1] for a in by_kind.get("ServiceAccount", [])):
        out.append(f"{_name(d)}: no ServiceAccount {sa[1]}")
    grants = _grants(by_kind, sa)
    want = [{"apiGroups": ["apps"], "resources": ["deployments/scale"], "resourceNames": sorted(targets),
             "verbs": PLANNER_VERBS}]
    if len(grants) != 1 or grants[0][0]["kind"] != "RoleBinding" or grants[0][1]["kind"] != "Role":
        out.append(f"ServiceAccount/{sa[1]}: needs exactly one RoleBinding to a Role, has "
                   f"{[(_name(b), _name(r)) for b, r in grants]}")
    for b, role in grants:
        rules = [{k: sorted(v) for k, v in r.items()} for r in role.get("rules") or ()]
        if rules != want:
            out.append(f"{_name(role)} (bound to the planner): rules {rules}; only {want} is allowed")
        others = [x for x in b.get("subjects") or () if (x.get("namespace", ""), x.get("name")) != sa]
        if others:
            out.append(f"{_name(b)}: binds the planner's Role to others too: {others}")
    planner_roles = {(r["kind"], r["metadata"]["name"]) for _, r in grants}
    for kind in ("Role", "ClusterRole"):
        for r in by_kind.get(kind, []):
            if (kind, r["metadata"]["name"]) in planner_roles:
                continue
            for rule in r.get("rules") or ():
                if {"deployments", "deployments/scale", "*"} & set(rule.get("resources") or ()):
                    out.append(f"{_name(r)}: grants {rule.get('verbs')} on {rule.get('resources')}: only the "
                               "planner may touch Deployments' scale")
    return out


def _secret_problems(pod: dict, c: dict, where: str) -> list[str]:
    """Every service reads the deployment's internal secret from a mounted Secret (docs/security.md)."""
    path = next((a.split("=", 1)[1] for a in c.get("args") or () if a.startswith("--internal-token-file=")), None)
    if path is None:
        return [f"{where}: no --internal-token-file: internal gRPC would be open to anyone in the cluster"]
    secrets = {v["name"] for v in pod.get("volumes") or () if "secret" in v}
    mounted = any(m["name"] in secrets and path.startswith(m["mountPath"].rstrip("/") + "/")
                  for m in c.get("volumeMounts") or ())
    return [] if mounted else [f"{where}: --internal-token-file {path} is not in a mounted Secret volume"]


def _flag(container: dict, name: str, env: dict[str, str] | None = None) -> float | None:
    """A numeric flag of `container`'s args; `$(VAR)` resolved from `env` (its ConfigMap variables)."""
    value = _arg(container, name)
    if value is None:
        return None
    if value.startswith("$(") and value.endswith(")"):
        value = (env or {}).get(value[2:-1], "")
    try:
        return float(value)
    except ValueError:
        return None


def _arg(container: dict, name: str) -> str | None:
    for a in container.get("args") or ():
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _container_vars(c: dict, configmaps: dict[str, dict]) -> dict[str, str]:
    env: dict[str, str] = {}
    for src in c.get("envFrom") or ():
        env.update({str(k): str(v) for k, v in configmaps.get((src.get("configMapRef") or {}).get("name"), {}).items()})
    env.update({e["name"]: str(e["value"]) for e in c.get("env") or () if "value" in e})
    return env


def _role(o: dict) -> str:
    return (o["metadata"].get("labels") or {}).get("tandem.ai/role", "")


def _selects(selector: dict | None, d: dict) -> bool:
    labels = d["spec"]["template"]["metadata"].get("labels") or {}
    want = (selector or {}).get("matchLabels") or {}
    return bool(want) and all(labels.get(k) == v for k, v in want.items())


def _name(o: dict) -> str:
    return f"{o.get('kind')}/{(o.get('metadata') or {}).get('name')}"


def checkov_skips(k8s: Path, overlay: Path, objs: list[dict]) -> tuple[dict[str, str], list[str]]:
    skips: dict[str, str] = {}
    problems = []
    for f in (k8s / "checkov-skips.yaml", overlay / "checkov-skips.yaml"):
        if f.is_file():
            for check, reason in (yaml.safe_load(f.read_text()) or {}).items():
                if not str(reason or "").strip():
                    problems.append(f"{f}: skip of {check} has no reason")
                skips[check] = str(reason)
    for o in objs:
        for key, value in ((o["metadata"].get("annotations") or {}).items()):
            if key.startswith("checkov.io/skip"):
                check, _, reason = str(value).partition("=")
                if not reason.strip():
                    problems.append(f"{_name(o)}: annotation {key} skips {check} without a reason")
    return skips, problems


def checkov_problems(objs: list[dict], skips: dict[str, str], checkov: Path) -> list[str]:
    if not checkov.exists():
        return [f"checkov not found at {checkov} (make install puts it there)"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rendered.yaml"
        path.write_text(yaml.safe_dump_all(objs, sort_keys=False))
        cmd = [str(checkov), "-f", str(path), "--framework", "kubernetes", "-o", "json", "--quiet",
               "--compact", "--skip-download"]
        if skips:
            cmd += ["--skip-check", ",".join(sorted(skips))]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return [f"checkov did not report (exit {proc.returncode}): {proc.stderr[-2000:]}"]
    reports = report if isinstance(report, list) else [report]
    out = []
    for r in reports:
        for f in (r.get("results") or {}).get("failed_checks") or ():
            out.append(f"{f.get('resource')}: checkov {f.get('check_id')}: {f.get('check_name')}")
    return out


def render_all(overlay: Path) -> tuple[list[dict] | None, list[str]]:
    """The overlay's objects as every kubectl renders them (one list: they must agree), and problems."""
    try:
        tools = kubectls()
    except RenderError as e:
        return None, [f"render: {e}"]
    texts, problems = {}, []
    for kubectl in tools:
        try:
            texts[kubectl] = render_text(overlay, kubectl)
        except RenderError as e:
            problems.append(f"render: {e}")
    if len(set(texts.values())) > 1:
        problems.append("render: the kubectls disagree: " + ", ".join(str(k) for k in texts))
    if problems or not texts:
        return None, problems
    try:
        return [d for d in yaml.safe_load_all(next(iter(texts.values()))) if d], []
    except yaml.YAMLError as e:
        return None, [f"render: {e}"]


def source_problems(k8s: Path) -> list[str]:
    """Constructs the kustomize of an older kubectl cannot take, though today's does: `$patch: delete`
    (kubectl 1.32's kustomize v5.5.0 panics on it in a component). k8s/ composes components instead."""
    return [f"{p.relative_to(k8s.parent)}: `$patch: delete` (older kustomize panics on it; use a component)"
            for p in sorted(k8s.rglob("*.yaml")) if re.search(r"^\s*\$patch:\s*delete\b", p.read_text(), re.M)]


def check(k8s: Path = ROOT / "k8s", checkov: Path = DEFAULT_CHECKOV, run_checkov: bool = True) -> dict[str, list[str]]:
    """Problems per overlay (empty lists: all good)."""
    results = {}
    everywhere = source_problems(k8s)
    for overlay in overlays(k8s):
        objs, problems = render_all(overlay)
        problems = everywhere + problems
        if objs is None:
            results[overlay.name] = problems
            continue
        try:
            problems += schema_problems(objs) + invariants(objs)
        except KeyError as e:
            problems.append(f"malformed object: no {e}")
        if run_checkov:
            skips, skip_problems = checkov_skips(k8s, overlay, objs)
            problems += skip_problems + checkov_problems(objs, skips, checkov)
        results[overlay.name] = problems
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k8s", type=Path, default=ROOT / "k8s")
    ap.add_argument("--checkov", type=Path, default=DEFAULT_CHECKOV)
    ap.add_argument("--out", type=Path, default=None, help="also write each rendered overlay here")
    args = ap.parse_args(argv)
    results = check(args.k8s, args.checkov)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for overlay in overlays(args.k8s):
            (args.out / f"{overlay.name}.yaml").write_text(render_text(overlay))
    try:
        tools = ", ".join(str(k) for k in kubectls())
    except RenderError as e:
        tools = str(e)
    failed = 0
    for name, problems in results.items():
        print(f"k8s/overlays/{name}: {'ok' if not problems else f'{len(problems)} problems'} "
              f"(rendered by {tools}; Kubernetes {KUBERNETES_VERSION} strict schemas, Tandem invariants, checkov)")
        for p in problems:
            print(f"  - {p}")
        failed += bool(problems)
    if not results:
        print("no overlays found")
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
