"""`make k8s-check`: render every overlay of k8s/ and check each object three ways.

1. Schema: `kubernetes-validate --strict` against the OpenAPI schemas of KUBERNETES_VERSION (unknown
   or misspelt fields fail).
2. Tandem's own invariants (`invariants`): every role has a Deployment with probes, resources, a
   locked-down securityContext and a drain-sized grace period, a PodDisruptionBudget and an HPA.
3. Security posture: checkov on the rendered manifests, zero failures; each skipped check has a
   written reason (k8s/checkov-skips.yaml, an overlay's checkov-skips.yaml, or a resource's
   `checkov.io/skipN: ID=reason` annotation).

Rendering uses tests/k8s/render.py (kubectl/kustomize are not installable here).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from tests.k8s.render import RenderError, render

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_VERSION = "1.33.0"
ROLES = ("gateway", "router", "prefill", "decode")
WORKERS = ("prefill", "decode")
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
    for role in ROLES:
        d = deployments.get(role)
        if d is None:
            out.append(f"no Deployment labelled tandem.ai/role={role}")
            continue
        out += _deployment_problems(d, role)
        if not any(_selects(p["spec"].get("selector"), d) for p in by_kind.get("PodDisruptionBudget", [])):
            out.append(f"{_name(d)}: no PodDisruptionBudget selects its pods")
        if not any(h["spec"]["scaleTargetRef"]["name"] == d["metadata"]["name"]
                   for h in by_kind.get("HorizontalPodAutoscaler", [])):
            out.append(f"{_name(d)}: no HorizontalPodAutoscaler")
    for role in WORKERS:
        svcs = [s for s in by_kind.get("Service", []) if (s["metadata"].get("labels") or {}).get("tandem.ai/role") == role]
        if not svcs or any(s["spec"].get("clusterIP") != "None" for s in svcs):
            out.append(f"the {role} workers need a headless Service labelled tandem.ai/role={role}")
    if not by_kind.get("NetworkPolicy"):
        out.append("no NetworkPolicy")
    return out


def _deployment_problems(d: dict, role: str) -> list[str]:
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
        if role != "gateway" and not grpc_probe:
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
        if not ((c.get("lifecycle") or {}).get("preStop")):
            out.append(f"{where}: no preStop hook")
        out += _secret_problems(pod, c, where)
        drain = _flag(c, "--drain-timeout")
        if drain is not None and drain + 5 >= grace:
            out.append(f"{where}: terminationGracePeriodSeconds {grace} leaves no room for --drain-timeout {drain}")
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


def _flag(container: dict, name: str) -> float | None:
    for a in container.get("args") or ():
        if a.startswith(name + "="):
            value = a.split("=", 1)[1]
            try:
                return float(value)
            except ValueError:
                return None   # $(VAR): checked through the ConfigMap by the caller's docs
    return None


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


def check(k8s: Path = ROOT / "k8s", checkov: Path = DEFAULT_CHECKOV, run_checkov: bool = True) -> dict[str, list[str]]:
    """Problems per overlay (empty lists: all good)."""
    results = {}
    for overlay in overlays(k8s):
        try:
            objs = render(overlay)
        except (RenderError, yaml.YAMLError, KeyError) as e:
            results[overlay.name] = [f"render: {e}"]
            continue
        problems = schema_problems(objs) + invariants(objs)
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
            (args.out / f"{overlay.name}.yaml").write_text(yaml.safe_dump_all(render(overlay), sort_keys=False))
    failed = 0
    for name, problems in results.items():
        print(f"k8s/overlays/{name}: {'ok' if not problems else f'{len(problems)} problems'} "
              f"(Kubernetes {KUBERNETES_VERSION}, strict schemas, Tandem invariants, checkov)")
        for p in problems:
            print(f"  - {p}")
        failed += bool(problems)
    if not results:
        print("no overlays found")
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
