"""Router configuration: one frozen dataclass, built from the command line in one place."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from tandem.services.common.arg_groups import DEPLOYMENT, RESILIENCE, ROUTING, SCHEDULER
from tandem.services.common.auth import API_KEY, INTERNAL_TOKEN_FILE, InternalAuth, load_api_key
from tandem.services.common.flags import Flag, Owner, add_flags
from tandem.services.common.limits import LIMIT_FLAGS, RequestLimits
from tandem.services.common.shared_flags import (
    DRAIN_TIMEOUT,
    HOST,
    MAX_INFLIGHT,
    METRICS_PORT,
    MODEL_FLAG,
    OTLP_TRACES_ENDPOINT,
    PORT,
    QUEUE_FLAGS,
    REDIS_URL,
    REQUEST_TIMEOUT,
)
from tandem.services.common.tls import TLS_FLAGS, tls_from_args
from tandem.services.router.policy import policy_names
from tandem.services.router.route_config import ROUTE_FLAGS, RouteConfig, route_config_from_args
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
    model: str = ""  # the model of static workers without WorkerIdentity; empty = accept any requested model
    probe_s: float = 2.0  # static workers: health and WorkerIdentity period; 0 = asked at start, never dropped
    policy: str = "cache_aware"  # measured better than round_robin (docs/benchmarks.md)
    mode: str = "disagg"
    # Prefill workers the router needs to serve (disagg). 0: with none registered (or none usable) every
    # prompt is prefilled on its decode worker (the "local" route): serving with decode workers only.
    min_prefill_workers: int = 1
    metrics_port: int = -1  # 0 = pick a free port, -1 = no metrics endpoint
    max_inflight: int = 1024
    max_queued_requests: int = 0  # requests waiting for an in-flight slot; 0 = refuse beyond max_inflight
    enable_priority_scheduling: bool = False  # the queue serves higher `priority` first (see queue_policy)
    low_priority_values_first: bool = False
    # Longest wait for an in-flight slot (admission.py); also the deadline, for the queue's order, of a
    # request without one. 0: only the request's deadline bounds the wait. SGLang router's default.
    queue_timeout_s: float = 60.0
    request_timeout_s: float = 600.0  # 0 = no router-side deadline
    drain_timeout_s: float = 5.0
    max_retries: int = 1  # extra attempts on another pair, only on UNAVAILABLE before the first token
    # Resubmissions of a stream that broke after tokens reached the client (servicer.py, migration.py).
    # 2: one worker death, plus one failed continuation (e.g. onto a worker that died in the same
    # event and is still registered until its TTL); more is likely a systemic failure, and each
    # migration re-prefills a longer prompt.
    max_migrations: int = 2
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
        if self.min_prefill_workers < 0:
            raise ValueError(f"--min-prefill-workers must be >= 0, got {self.min_prefill_workers}")
        if not 0 <= self.port < 65536 or not -1 <= self.metrics_port < 65536:
            raise ValueError("ports must be in [0, 65535] (metrics: -1 = off)")
        if self.max_inflight < 1:
            raise ValueError(f"--max-inflight must be >= 1, got {self.max_inflight}")
        if self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")
        if not self.queue_timeout_s >= 0:
            raise ValueError(f"--queue-timeout-secs must be >= 0, got {self.queue_timeout_s}")
        if self.request_timeout_s < 0 or self.drain_timeout_s < 0 or self.max_retries < 0 or self.max_migrations < 0:
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
            min_prefill_workers=args.min_prefill_workers,
            metrics_port=args.metrics_port,
            max_inflight=args.max_inflight,
            max_queued_requests=args.max_queued_requests,
            enable_priority_scheduling=args.enable_priority_scheduling,
            low_priority_values_first=args.low_priority_values_first,
            queue_timeout_s=args.queue_timeout_secs,
            request_timeout_s=args.request_timeout,
            drain_timeout_s=args.drain_timeout,
            max_retries=args.retry_max_retries,
            max_migrations=args.max_migrations,
            circuit_breaker=args.circuit_breaker,
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


def _addresses(role: str) -> Flag:
    # A homonym of `tandem up`'s worker counts (tests/tandem/test_flags.py).
    return Flag((f"--{role}",), Owner.ROUTER, DEPLOYMENT, f"static {role} worker addresses host:port, comma "
                f"separated or repeated", action="append", metavar="ADDR", up=Owner.NONE)


MODE = Flag(("--mode",), Owner.ROUTER | Owner.LAUNCHER, DEPLOYMENT,
            "disagg: separate prefill and decode workers, a request goes to a pair; colocated: each worker does "
            "both", field="mode", choices=MODES)
MIN_PREFILL_WORKERS = Flag(
    ("--min-prefill-workers",), Owner.ROUTER, DEPLOYMENT,
    "disagg: prefill workers that must be registered for the router to serve; 0: with none registered (or none "
    "usable) each decode worker prefills its own prompts (local route) and the router is ready with decode "
    "workers alone (what `tandem up --planner` runs, so that a shape may have no prefill worker)",
    field="min_prefill_workers", type=int, metavar="N")
POLICY = Flag(("--policy",), Owner.ROUTER, ROUTING,
              "how a (prefill, decode) pair is picked: in turn (round_robin), the least queued prefill work "
              "(least_load), or the best prefix-cache match unless loads are imbalanced (cache_aware)",
              field="policy", choices=policy_names)
# Discovery: `tandem up` runs the router on its own Redis, so none of these is a flag of `up`.
_DISCOVERY_FLAGS = (
    Flag(("--discovery",), Owner.ROUTER, DEPLOYMENT,
         "where workers are found: redis, static (--prefill/--decode lists) or k8s (ready EndpointSlices labelled "
         "tandem.ai/role; default: redis with --redis-url, else static)", choices=DISCOVERY, up=Owner.NONE),
    Flag(("--k8s-namespace",), Owner.ROUTER, DEPLOYMENT, "k8s discovery: namespace (default: the pod's)",
         field="k8s_namespace", up=Owner.NONE),
    Flag(("--k8s-selector",), Owner.ROUTER, DEPLOYMENT, "k8s discovery: label selector of worker EndpointSlices",
         field="k8s_selector", up=Owner.NONE),
    Flag(("--k8s-api-server",), Owner.ROUTER, DEPLOYMENT,
         "k8s discovery: API server URL (default: in-cluster service account, then ~/.kube/config)",
         field="k8s_api_server", up=Owner.NONE),
    Flag(("--registry-prefix",), Owner.ROUTER, DEPLOYMENT, "key prefix of the Redis registry",
         field="registry_prefix", up=Owner.NONE),
    _addresses("prefill"), _addresses("decode"), _addresses("colocated"),
    Flag(("--probe-interval",), Owner.ROUTER, DEPLOYMENT,
         "seconds between probes of static workers: gRPC health, and what each worker says it is "
         "(WorkerIdentity: id, boot epoch, model); 0: asked once, never dropped", field="probe_s", type=float,
         up=Owner.NONE),
)
# Retries and circuit breakers, under SGLang router's names.
RESILIENCE_FLAGS = (
    Flag(("--retry-max-retries",), Owner.ROUTER, RESILIENCE,
         "a request that fails with UNAVAILABLE before anything reached the client is tried again on another "
         "(prefill, decode) pair, up to this many times", field="max_retries", type=int),
    Flag(("--max-migrations",), Owner.ROUTER, RESILIENCE,
         "a stream that breaks with UNAVAILABLE after tokens reached the client is continued on another pair "
         "(prompt + the tokens already sent; no token repeated or missing), up to this many times per request; "
         "0: it fails", field="max_migrations", type=int),
    Flag(("--cb-failure-threshold",), Owner.ROUTER, RESILIENCE,
         "consecutive UNAVAILABLE failures after which a worker's circuit opens (it gets no new requests until "
         "the timeout passes, unless every worker of its role is open)", field="cb_failure_threshold", type=int),
    Flag(("--cb-timeout-duration-secs",), Owner.ROUTER, RESILIENCE,
         "seconds an opened circuit keeps its worker out; doubles while it keeps failing", field="cb_timeout_s",
         type=float),
    Flag(("--disable-circuit-breaker",), Owner.ROUTER, RESILIENCE,
         "never skip a failing worker (requests are still retried on another pair; default: a worker's circuit "
         "opens after --cb-failure-threshold failures)", field="circuit_breaker", action="store_false",
         dest="circuit_breaker"),
)
# SGLang router's name and default (its --queue-size is our shared --max-queued-requests).
QUEUE_TIMEOUT = Flag(("--queue-timeout-secs",), Owner.ROUTER, SCHEDULER,
                     "seconds a request may wait in the router queue for an in-flight slot (--max-queued-requests); "
                     "a waiter that cannot start within it, or before its own deadline, is shed at once with "
                     "RESOURCE_EXHAUSTED / HTTP 429 rather than served late; waiters are served by priority, then "
                     "earliest deadline (0: only the request's deadline bounds the wait)", field="queue_timeout_s",
                     type=float, metavar="SECONDS")
ROUTER_FLAGS = (
    HOST, PORT, MODE, MIN_PREFILL_WORKERS, REDIS_URL, *_DISCOVERY_FLAGS, MODEL_FLAG, POLICY, *ROUTE_FLAGS, METRICS_PORT, OTLP_TRACES_ENDPOINT, MAX_INFLIGHT,
    *QUEUE_FLAGS, QUEUE_TIMEOUT, REQUEST_TIMEOUT, DRAIN_TIMEOUT, API_KEY, INTERNAL_TOKEN_FILE, *TLS_FLAGS, *LIMIT_FLAGS,
    *RESILIENCE_FLAGS,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, ROUTER_FLAGS, {Owner.ROUTER: RouterConfig()})
