"""Router configuration: one frozen dataclass, built from the command line in one place."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from services.common.arg_groups import (
    DEPLOYMENT,
    LIMITS,
    OBSERVABILITY,
    RESILIENCE,
    ROUTING,
    SCHEDULER,
    arg_group,
)
from services.common.auth import InternalAuth, add_api_key_argument, add_internal_auth_arguments, load_api_key
from services.common.limits import RequestLimits, add_limit_arguments
from services.common.tls import add_tls_arguments, tls_from_args
from services.router.policy import policy_names
from services.router.route_config import RouteConfig, add_route_arguments, route_config_from_args
from tandem.v1 import worker_pb2

MODES = ("disagg", "colocated")
DISCOVERY = ("redis", "static", "k8s")


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = pick a free port
    redis_url: str | None = None
    registry_prefix: str = "tandem"
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    colocated: tuple[str, ...] = ()
    model: str = ""  # what ListModels reports for static workers; empty = accept any requested model
    probe_s: float = 2.0  # health-probe period of static workers; 0 = never drop them
    policy: str = "cache_aware"  # measured better than round_robin (docs/benchmarks.md)
    mode: str = "disagg"
    metrics_port: int = -1  # 0 = pick a free port, -1 = no metrics endpoint
    max_inflight: int = 1024
    max_queued_requests: int = 0  # requests waiting for an in-flight slot; 0 = refuse beyond max_inflight
    enable_priority_scheduling: bool = False  # the queue serves higher `priority` first (see queue_policy)
    low_priority_values_first: bool = False
    request_timeout_s: float = 600.0  # 0 = no router-side deadline
    drain_timeout_s: float = 5.0
    max_retries: int = 1  # extra attempts on another pair, only on UNAVAILABLE before the first token
    circuit_breaker: bool = True  # skip a worker after cb_failure_threshold UNAVAILABLEs in a row (breaker.py)
    cb_failure_threshold: int = 3
    cb_timeout_s: float = 5.0  # how long an opened circuit skips its worker (doubles while it keeps failing)
    discovery: str = ""  # redis | static | k8s; "" = redis with --redis-url, else static
    k8s_namespace: str = ""  # "" = this pod's namespace
    k8s_selector: str = "app.kubernetes.io/part-of=tandem"  # EndpointSlices of the worker Services
    k8s_api_server: str | None = None  # None = in-cluster service account, then ~/.kube/config
    route: RouteConfig = field(default_factory=RouteConfig)  # cache, load and local-prefill weights
    # Secrets (services/common/auth.py), never printed: the internal one workers require of the router
    # (and the router accepts from the gateway), and the optional key of the public Generation API.
    auth: InternalAuth = field(default_factory=InternalAuth, repr=False)
    limits: RequestLimits = RequestLimits()
    api_key: str | None = field(default=None, repr=False)

    @property
    def discovery_kind(self) -> str:
        if self.discovery:
            return self.discovery
        return "redis" if self.redis_url else "static"

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {MODES}, got {self.mode!r}")
        if self.policy not in policy_names():
            raise ValueError(f"--policy must be one of {policy_names()}, got {self.policy!r}")
        static = self.prefill or self.decode or self.colocated
        if self.discovery and self.discovery not in DISCOVERY:
            raise ValueError(f"--discovery must be one of {DISCOVERY}, got {self.discovery!r}")
        if self.discovery_kind == "k8s":
            if self.redis_url or static:
                raise ValueError("--discovery k8s takes no --redis-url or static worker addresses")
        elif self.redis_url and static:
            raise ValueError("give either --redis-url or --prefill/--decode/--colocated, not both")
        if self.discovery_kind == "redis" and not self.redis_url:
            raise ValueError("--discovery redis needs --redis-url")
        if self.discovery_kind != "k8s" and not self.redis_url and not static:
            raise ValueError("no registry: give --redis-url, or worker addresses with --prefill/--decode/--colocated")
        if static and self.mode == "disagg" and not (self.prefill and self.decode):
            raise ValueError("--mode disagg needs at least one --prefill and one --decode address")
        if static and self.mode == "colocated" and not self.colocated:
            raise ValueError("--mode colocated needs at least one --colocated address")
        if not 0 <= self.port < 65536 or not -1 <= self.metrics_port < 65536:
            raise ValueError("ports must be in [0, 65535] (metrics: -1 = off)")
        if self.max_inflight < 1:
            raise ValueError(f"--max-inflight must be >= 1, got {self.max_inflight}")
        if self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")
        if self.request_timeout_s < 0 or self.drain_timeout_s < 0 or self.max_retries < 0:
            raise ValueError("timeouts and retries must be >= 0")
        if self.cb_failure_threshold < 1 or self.cb_timeout_s <= 0:
            raise ValueError("--cb-failure-threshold must be >= 1 and --cb-timeout-duration-secs > 0")
        self.route.validate()

    @property
    def roles(self) -> tuple[int, ...]:
        """The worker roles a request is routed to in this mode."""
        if self.mode == "colocated":
            return (worker_pb2.WORKER_ROLE_COLOCATED,)
        return (worker_pb2.WORKER_ROLE_PREFILL, worker_pb2.WORKER_ROLE_DECODE)

    @property
    def grpc_addr(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterConfig:
        config = cls(
            host=args.host,
            port=args.port,
            redis_url=args.redis_url or None,
            registry_prefix=args.registry_prefix,
            prefill=_addr_list(args.prefill),
            decode=_addr_list(args.decode),
            colocated=_addr_list(args.colocated),
            model=args.model,
            probe_s=args.probe_interval,
            policy=args.policy,
            mode=args.mode,
            metrics_port=args.metrics_port,
            max_inflight=args.max_inflight,
            max_queued_requests=args.max_queued_requests,
            enable_priority_scheduling=args.enable_priority_scheduling,
            low_priority_values_first=args.low_priority_values_first,
            request_timeout_s=args.request_timeout,
            drain_timeout_s=args.drain_timeout,
            max_retries=args.retry_max_retries,
            circuit_breaker=not args.disable_circuit_breaker,
            cb_failure_threshold=args.cb_failure_threshold,
            cb_timeout_s=args.cb_timeout_duration_secs,
            discovery=args.discovery or "",
            k8s_namespace=args.k8s_namespace,
            k8s_selector=args.k8s_selector,
            k8s_api_server=args.k8s_api_server or None,
            route=route_config_from_args(args),
            auth=InternalAuth.load(args.internal_token_file, tls=tls_from_args(args)),
            api_key=load_api_key(args.api_key),
            limits=RequestLimits.from_args(args),
        )
        config.validate()
        return config


def _addr_list(values: list[str] | None) -> tuple[str, ...]:
    # Accepts both `--prefill a,b` and `--prefill a --prefill b`.
    return tuple(a.strip() for v in values or () for a in v.split(",") if a.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = RouterConfig()
    where = arg_group(p, DEPLOYMENT)
    where.add_argument("--host", default=d.host, help="address to listen on")
    where.add_argument("--port", type=int, default=d.port, help="gRPC port (0 = pick a free one)")
    where.add_argument("--mode", choices=MODES, default=d.mode,
                       help="route to prefill+decode pairs or to co-located workers")
    where.add_argument("--redis-url", default=None,
                       help="registry, e.g. redis://127.0.0.1:6379/0 or unix:///path/redis.sock")
    where.add_argument("--discovery", choices=DISCOVERY, default=None,
                       help="where workers are found: redis, static (--prefill/--decode lists) or k8s (ready "
                            "EndpointSlices labelled tandem.ai/role; default: redis with --redis-url, else static)")
    where.add_argument("--k8s-namespace", default=d.k8s_namespace,
                       help="k8s discovery: namespace (default: the pod's)")
    where.add_argument("--k8s-selector", default=d.k8s_selector,
                       help="k8s discovery: label selector of worker EndpointSlices")
    where.add_argument("--k8s-api-server", default=None,
                       help="k8s discovery: API server URL (default: in-cluster service account, then "
                            "~/.kube/config)")
    where.add_argument("--registry-prefix", default=d.registry_prefix, help="key prefix of the Redis registry")
    where.add_argument("--prefill", action="append", help="static prefill worker addresses host:port, comma separated")
    where.add_argument("--decode", action="append", help="static decode worker addresses, comma separated")
    where.add_argument("--colocated", action="append", help="static co-located worker addresses, comma separated")
    where.add_argument("--model", default=d.model, help="model id of static workers (reported by ListModels)")
    where.add_argument("--probe-interval", type=float, default=d.probe_s,
                       help="seconds between gRPC health probes of static workers (0 = never drop them)")
    arg_group(p, ROUTING).add_argument(
        "--policy", choices=policy_names(), default=d.policy,
        help="how a (prefill, decode) pair is picked: in turn (round_robin), the least queued prefill work "
             f"(least_load), or the best prefix-cache match unless loads are imbalanced (cache_aware) "
             f"(default: {d.policy})")
    add_route_arguments(p)
    arg_group(p, OBSERVABILITY).add_argument("--metrics-port", type=int, default=d.metrics_port,
                                             help="Prometheus port (0 = pick free, -1 = off)")
    arg_group(p, LIMITS).add_argument("--max-inflight", type=int, default=d.max_inflight,
                                      help="requests in flight beyond which new ones get RESOURCE_EXHAUSTED at once")
    queue = arg_group(p, SCHEDULER)
    queue.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                       help="requests beyond --max-inflight that wait for a slot; when full, the one that would "
                            "be served last (the newcomer unless it outranks someone) gets RESOURCE_EXHAUSTED at "
                            "once; 0: none wait")
    queue.add_argument("--enable-priority-scheduling", action="store_true",
                       help="waiting requests are served by `priority`, then arrival (default: arrival only)")
    queue.add_argument("--low-priority-values-first", action="store_true",
                       help="a lower `priority` value is more urgent (default: a higher one)")
    timeouts = arg_group(p, RESILIENCE)
    timeouts.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                          help="seconds per request (0 = none)")
    timeouts.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s,
                          help="seconds to let in-flight requests finish on SIGTERM")
    add_api_key_argument(p, "callers of tandem.v1.Generation (and of reflection) must send the gRPC metadata "
                            "`authorization: Bearer KEY` (or the internal token, as the gateway does)")
    add_internal_auth_arguments(p)
    add_tls_arguments(p)
    add_limit_arguments(p)
    add_resilience_arguments(p, d)


def add_resilience_arguments(p: argparse.ArgumentParser, d: RouterConfig) -> None:
    """Retry and circuit-breaker flags (SGLang router names); `tandem up` takes and forwards them too."""
    g = arg_group(p, RESILIENCE)
    g.add_argument("--retry-max-retries", type=int, default=d.max_retries,
                   help="a request that fails with UNAVAILABLE before anything reached the client is tried again "
                        "on another (prefill, decode) pair, up to this many times")
    g.add_argument("--cb-failure-threshold", type=int, default=d.cb_failure_threshold,
                   help="consecutive UNAVAILABLE failures after which a worker's circuit opens (it gets no new "
                        "requests until the timeout passes, unless every worker of its role is open)")
    g.add_argument("--cb-timeout-duration-secs", type=float, default=d.cb_timeout_s,
                   help="seconds an opened circuit keeps its worker out; doubles while it keeps failing")
    g.add_argument("--disable-circuit-breaker", action="store_true",
                   help="never skip a failing worker (requests are still retried on another pair; default: a "
                        "worker's circuit opens after --cb-failure-threshold failures)")
