"""Where the Kubernetes actuator acts: the namespace, the two Deployments it scales, the API server.

`KubernetesTarget` is the frozen config of `services/planner/k8s.py`; `K8S_FLAGS` are its flags
(`tandem planner --planner-target kubernetes ...`), `k8s_target_from_args` builds it from the parsed
command line. Nothing here reads the environment or the pod's files: an empty namespace means "the
pod's own", resolved by the actuator when it is created.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from tandem.services.common.arg_groups import DEPLOYMENT
from tandem.services.common.flags import Flag, Owner


@dataclass(frozen=True)
class KubernetesTarget:
    namespace: str = ""                       # "" = this pod's namespace (service-account mount)
    prefill_deployment: str = "tandem-prefill"
    decode_deployment: str = "tandem-decode"
    api_server: str | None = None             # None = in-cluster service account, then ~/.kube/config
    request_timeout_s: float = 5.0            # per API call: the planner's loop never waits longer

    def validate(self) -> None:
        if not self.prefill_deployment or not self.decode_deployment:
            raise ValueError("--prefill-deployment and --decode-deployment need a name")
        if self.prefill_deployment == self.decode_deployment:
            raise ValueError(f"prefill and decode are one Deployment ({self.prefill_deployment}): "
                             "the planner scales the two roles apart")
        if self.request_timeout_s <= 0:
            raise ValueError("--k8s-request-timeout must be > 0")


_DEFAULT = KubernetesTarget()
# Not flags of `tandem up` (up=Owner.NONE: its planner acts on the host): `tandem planner` only.
# Their names differ from the router's `--k8s-namespace` / `--k8s-api-server` (k8s discovery), which
# say where EndpointSlices are read; these say which Deployments are scaled.
K8S_FLAGS = (
    Flag(("--deployments-namespace",), Owner.PLANNER, DEPLOYMENT,
         "--planner-target kubernetes: namespace of the prefill and decode Deployments (default: the pod's)",
         default=_DEFAULT.namespace, up=Owner.NONE),
    Flag(("--prefill-deployment",), Owner.PLANNER, DEPLOYMENT,
         "--planner-target kubernetes: the prefill workers' Deployment, scaled through deployments/scale",
         default=_DEFAULT.prefill_deployment, up=Owner.NONE),
    Flag(("--decode-deployment",), Owner.PLANNER, DEPLOYMENT,
         "--planner-target kubernetes: the decode workers' Deployment, scaled through deployments/scale",
         default=_DEFAULT.decode_deployment, up=Owner.NONE),
    Flag(("--kube-api-server",), Owner.PLANNER, DEPLOYMENT,
         "--planner-target kubernetes: API server URL, e.g. a `kubectl proxy` (default: in-cluster service "
         "account, then ~/.kube/config)", default=_DEFAULT.api_server, up=Owner.NONE),
    Flag(("--k8s-request-timeout",), Owner.PLANNER, DEPLOYMENT,
         "--planner-target kubernetes: seconds one API call may take", type=float,
         default=_DEFAULT.request_timeout_s, up=Owner.NONE),
)


def add_k8s_arguments(p: argparse.ArgumentParser) -> None:
    for flag in K8S_FLAGS:
        flag.add_to(p, flag.default)


def k8s_target_from_args(args: argparse.Namespace) -> KubernetesTarget:
    target = KubernetesTarget(namespace=args.deployments_namespace, prefill_deployment=args.prefill_deployment,
                              decode_deployment=args.decode_deployment, api_server=args.kube_api_server,
                              request_timeout_s=args.k8s_request_timeout)
    target.validate()
    return target
