"""Check-only renderer for Tandem's own kustomizations (k8s/), for `make k8s-check` and its tests.

Not a kustomize: kubectl and kustomize binaries are not installable here, so the check resolves the
small subset of kustomization.yaml that k8s/ uses -- `resources` (files and directories), `components`
(kind: Component, applied after the resources and before the including kustomization's own patches,
as kustomize does), `namespace`, `images`, `replicas` and strategic-merge `patches` (by file, target
taken from the patch's kind and name; `$patch: delete` removes the target) -- and refuses any other field, so k8s/ cannot start using a feature this renderer would
silently ignore. Users deploy with `kubectl apply -k`, which uses the real kustomize.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "components", "namespace", "images", "replicas", "patches"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass", "StorageClass",
                  "CustomResourceDefinition", "PersistentVolume", "RuntimeClass"}
SCALABLE = {"Deployment", "StatefulSet", "ReplicaSet", "ReplicationController"}
# Strategic-merge keys of the Kubernetes types k8s/ patches (lists not named here are replaced).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "envFrom": None,
              "volumes": "name", "volumeMounts": "mountPath", "imagePullSecrets": "name"}


class RenderError(Exception):
    pass


def render(path: str | Path) -> list[dict]:
    """The objects `kubectl kustomize PATH` would print, for the subset described above."""
    return _build(Path(path), [], component=False)


def _build(root: Path, objs: list[dict], component: bool) -> list[dict]:
    """`objs` (what a component is applied to; [] for a kustomization) with `root`'s resources and edits."""
    kfile = root / "kustomization.yaml"
    if not kfile.is_file():
        raise RenderError(f"{root}: no kustomization.yaml")
    k = yaml.safe_load(kfile.read_text()) or {}
    unknown = set(k) - SUPPORTED
    if unknown:
        raise RenderError(f"{kfile}: fields {sorted(unknown)} are not supported by the check renderer")
    if (k.get("kind") == "Component") != component:
        raise RenderError(f"{kfile}: kind {k.get('kind')!r} where a {'Component' if component else 'Kustomization'}"
                          " is expected")
    objs = list(objs)
    for res in k.get("resources") or ():
        p = root / res
        objs += render(p) if p.is_dir() else _load(p)
    for comp in k.get("components") or ():
        objs = _build(root / comp, objs, component=True)
    for patch in k.get("patches") or ():
        if set(patch) != {"path"}:
            raise RenderError(f"{kfile}: only `patches: - path: FILE` is supported, got {patch}")
        for doc in _load(root / patch["path"]):
            _apply_patch(objs, doc, root / patch["path"])
    for r in k.get("replicas") or ():
        scalable = [o for o in objs if o["kind"] in SCALABLE]
        _find(scalable, None, r["name"], kfile)["spec"]["replicas"] = r["count"]
    for img in k.get("images") or ():
        _set_image(objs, img)
    if k.get("namespace"):
        _set_namespace(objs, k["namespace"])
    return objs


def _load(path: Path) -> list[dict]:
    if not path.is_file():
        raise RenderError(f"{path}: no such file")
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _find(objs: list[dict], kind: str | None, name: str, where: Path) -> dict:
    found = [o for o in objs if o["metadata"]["name"] == name and (kind is None or o["kind"] == kind)]
    if len(found) != 1:
        raise RenderError(f"{where}: {len(found)} objects match {kind or '*'}/{name}")
    return found[0]


def _apply_patch(objs: list[dict], patch: dict, where: Path) -> None:
    target = _find(objs, patch.get("kind"), patch["metadata"]["name"], where)
    if patch.get("$patch") == "delete":
        objs.remove(target)
        return
    merged = merge(target, patch)
    target.clear()
    target.update(merged)


def merge(base, patch, key: str | None = None):
    """Strategic merge of `patch` into `base` (copies; `null` deletes a key)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    mkey = MERGE_KEYS.get(key or "")
    if isinstance(base, list) and isinstance(patch, list) and mkey:
        out = copy.deepcopy(base)
        for item in patch:
            at = next((i for i, b in enumerate(out) if b.get(mkey) == item.get(mkey)), None)
            if at is None:
                out.append(copy.deepcopy(item))
            else:
                out[at] = merge(out[at], item)
        return out
    return copy.deepcopy(patch)


def _pod_specs(obj: dict) -> list[dict]:
    spec = obj.get("spec") or {}
    if obj["kind"] == "Pod":
        return [spec]
    tmpl = (spec.get("template") or {}).get("spec")
    return [tmpl] if tmpl else []


def _set_image(objs: list[dict], img: dict) -> None:
    for obj in objs:
        for pod in _pod_specs(obj):
            for c in [*pod.get("containers", ()), *pod.get("initContainers", ())]:
                name, _, tag = c["image"].partition(":")
                if name != img["name"]:
                    continue
                name = img.get("newName", name)
                tag = img.get("newTag", tag)
                c["image"] = f"{name}@{img['digest']}" if img.get("digest") else f"{name}:{tag}" if tag else name


def _set_namespace(objs: list[dict], ns: str) -> None:
    for obj in objs:
        if obj["kind"] in CLUSTER_SCOPED:
            continue
        obj["metadata"]["namespace"] = ns
        if obj["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            for s in obj.get("subjects") or ():
                if s.get("kind") == "ServiceAccount":
                    s["namespace"] = ns
