"""The planner's Kubernetes actuator: a shape is the `spec.replicas` of the prefill and decode Deployments.

It reads and patches only the Deployments' scale subresources (`apps/v1 deployments/scale`), which is
all its Role allows (k8s/overlays/planner: `get` and `patch`, on the two Deployments by name). The
shape running now is the two scales' `spec.replicas`; a reshape is in progress (`busy`) while a
Deployment's observed replicas (`status.replicas`) differ from its spec.

Scale-down is P/D-safe without the planner doing anything more: the ReplicaSet deletes a pod, whose
preStop pause lets routers see its endpoint go, then SIGTERM starts the worker's drain (no new rooms;
a prefill worker waits for the KV transfers it owes, a decode worker finishes its streams) within the
pod's terminationGracePeriodSeconds, which the manifests keep above the drain timeout (make k8s-check).

A shape with no prefill worker scales the prefill Deployment to 0: decode pods do not change role,
they prefill their own prompts (the router's local route), which the router serves only when started
with `--min-prefill-workers 0`; otherwise run the planner with `--planner-min-prefill 1` (make
k8s-check holds the two manifests to agree).

Failures of the API (403: RBAC, 404: a wrong name or namespace, the API server down, no credentials)
are logged once when they start and once when they end, and never raised: `current()` is None,
`busy()` is False and `apply()` does nothing, so the planner's next interval simply tries again.

Each call is one blocking HTTP request bounded by `request_timeout_s`; a server with an event loop
calls these methods in a thread (asyncio.to_thread). Torch-free; the `kubernetes` package is imported
when the API client is first made, not at import time.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from tandem.services.common.k8s_registry import pod_namespace
from tandem.services.planner.k8s_config import KubernetesTarget
from tandem.services.planner.shape import Shape

log = logging.getLogger(__name__)

FIELD_MANAGER = "tandem-planner"        # who changed replicas, in the Deployment's managedFields
MERGE_PATCH = "application/merge-patch+json"


@dataclasses.dataclass(frozen=True)
class Scale:
    """One Deployment's scale subresource: what is asked for and what the controller observes."""

    name: str
    spec: int
    status: int

    @property
    def settled(self) -> bool:
        return self.spec == self.status


class _Outage:
    """Logs a problem of one kind of call (reading, patching) when it starts or changes, and when it is
    over; never once per interval."""

    def __init__(self, what: str):
        self.what = what
        self.problem: str | None = None
        self.since = 0.0

    def failed(self, problem: str) -> None:
        if problem != self.problem:
            log.warning("kubernetes actuator: %s failed: %s (the planner keeps running and retries every interval)",
                        self.what, problem)
            self.problem, self.since = problem, time.monotonic()

    def ok(self) -> None:
        if self.problem is not None:
            log.info("kubernetes actuator: %s works again after %.0f s (was: %s)", self.what,
                     time.monotonic() - self.since, self.problem)
            self.problem = None


class KubernetesActuator:
    """Scales the prefill and decode Deployments; see the module docstring for what a caller may rely on."""

    name = "kubernetes"

    def __init__(self, target: KubernetesTarget, api=None):
        """`api`: an `AppsV1Api` (tests); default: made on first use from `target.api_server`, else the
        in-cluster service account, else ~/.kube/config."""
        assert target.namespace, "resolve the namespace first (from_config does)"
        target.validate()
        self.target = target
        self._api = api
        self._reading = _Outage("reading the Deployments' scale")
        self._patching = _Outage("patching the Deployments' scale")
        self._shape = _Outage("making a shape of the Deployments' replicas")
        self._applying: tuple[Shape, float] | None = None   # the shape asked for, when; until settled

    @classmethod
    def from_config(cls, cfg) -> KubernetesActuator:
        """From the planner's config (its `k8s` field, a KubernetesTarget) or a KubernetesTarget itself."""
        target = cfg if isinstance(cfg, KubernetesTarget) else cfg.k8s
        if not target.namespace:
            target = dataclasses.replace(target, namespace=pod_namespace())
        return cls(target)

    @property
    def problem(self) -> str | None:
        """The API problem now (None: the last reads and patches worked)."""
        return self._reading.problem or self._patching.problem or self._shape.problem

    # --- Actuator ---------------------------------------------------------------------------------
    def current(self) -> Shape | None:
        scales = self._read()
        if scales is None:
            return None
        prefill, decode = scales
        try:
            shape = Shape(prefill.spec, decode.spec)
        except ValueError:
            self._shape.failed(f"Deployment {decode.name} asks for {decode.spec} replicas: no shape without a "
                               "decode worker (scaled by hand?)")
            return None
        self._shape.ok()
        return shape

    def busy(self) -> bool:
        scales = self._read()
        if scales is None:
            return False          # unknown: the next interval reads again (current() is None meanwhile)
        moving = [s for s in scales if not s.settled]
        if not moving and self._applying is not None:
            shape, t0 = self._applying
            log.info("kubernetes actuator: %s reached (%s) after %.0f s", shape,
                     ", ".join(f"{s.name}={s.spec}" for s in scales), time.monotonic() - t0)
            self._applying = None
        return bool(moving)

    def apply(self, shape: Shape, reason: str) -> None:
        scales = self._read()
        if scales is None:
            return
        prefill, decode = scales
        wanted = [(prefill, shape.prefill), (decode, shape.decode)]
        # Grow before shrinking: capacity arrives first, and a pod that leaves drains anyway.
        changes = sorted(((s, n) for s, n in wanted if s.spec != n), key=lambda c: c[1] < c[0].spec)
        if not changes:
            return
        log.info("kubernetes actuator: %dP%dD -> %s (%s): %s", prefill.spec, decode.spec, shape, reason,
                 ", ".join(f"{s.name} {s.spec}->{n}" for s, n in changes))
        for s, n in changes:
            if not self._call(self._patching, lambda s=s, n=n: self._patch(s.name, n)):
                return        # the rest waits for the next interval, which sees current() != desired
        self._patching.ok()
        self._applying = (shape, time.monotonic())

    # --- API ----------------------------------------------------------------------------------------
    def _read(self) -> tuple[Scale, Scale] | None:
        out = []
        for name in (self.target.prefill_deployment, self.target.decode_deployment):
            s = self._call(self._reading, lambda name=name: self._read_scale(name))
            if s is None:
                return None
            out.append(s)
        self._reading.ok()
        return out[0], out[1]

    def _read_scale(self, name: str) -> Scale:
        obj = self._apps().read_namespaced_deployment_scale(name, self.target.namespace,
                                                            _request_timeout=self.target.request_timeout_s)
        spec = int(obj.spec.replicas or 0) if obj.spec is not None else 0
        status = int(obj.status.replicas or 0) if obj.status is not None else 0
        return Scale(name, spec, status)

    def _patch(self, name: str, replicas: int) -> bool:
        self._apps().patch_namespaced_deployment_scale(
            name, self.target.namespace, {"spec": {"replicas": replicas}}, field_manager=FIELD_MANAGER,
            _content_type=MERGE_PATCH, _request_timeout=self.target.request_timeout_s)
        return True

    def _call(self, outage: _Outage, fn):
        """fn()'s result, or None after logging (through `outage`) why the API did not answer it."""
        from kubernetes.client.exceptions import ApiException
        from kubernetes.config import ConfigException
        from urllib3.exceptions import HTTPError

        try:
            result = fn()
        except ApiException as e:
            outage.failed(self._explain(e))
            return None
        except ConfigException as e:
            outage.failed(f"no Kubernetes credentials (not in a pod, no ~/.kube/config, no "
                                f"--kube-api-server): {e}")
            return None
        except (HTTPError, OSError) as e:
            outage.failed(f"the API server {self._host()} does not answer: {type(e).__name__}: {e}")
            self._api = None    # a fresh client next time (e.g. a rotated service-account token)
            return None
        return result

    def _explain(self, e) -> str:
        names = f"{self.target.prefill_deployment} and {self.target.decode_deployment}"
        where = f"namespace {self.target.namespace}"
        if e.status == 403:
            return (f"403 Forbidden: the planner's ServiceAccount may not get/patch deployments/scale of {names} in "
                    f"{where} (its Role: k8s/overlays/planner/planner-rbac.yaml)")
        if e.status == 404:
            return (f"404 Not Found: no Deployment {names} in {where} (--prefill-deployment, --decode-deployment, "
                    "--deployments-namespace)")
        if e.status == 401:
            return "401 Unauthorized: the API server refuses the planner's credentials"
        if e.status == 409:
            return "409 Conflict: the scale changed underneath (another controller, e.g. an HPA, scales it too?)"
        return f"{e.status} {e.reason} from the API server {self._host()}"

    def _host(self) -> str:
        return self.target.api_server or "(in-cluster / kubeconfig)"

    def _apps(self):
        if self._api is None:
            self._api = self._make_api()
        return self._api

    def _make_api(self):
        from kubernetes import client, config  # imported here: no client library work at module import

        cfg = client.Configuration()
        if self.target.api_server:
            cfg.host = self.target.api_server
        else:
            try:
                config.load_incluster_config(client_configuration=cfg)
            except config.ConfigException:
                config.load_kube_config(client_configuration=cfg)
        cfg.retries = 1   # one retry of a dropped pooled connection; never a long reconnect loop in the planner
        return client.AppsV1Api(client.ApiClient(cfg))
