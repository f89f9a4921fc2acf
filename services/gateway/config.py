"""Gateway configuration: one frozen dataclass, built from the command line in one place."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from services.common.arg_groups import DEPLOYMENT, LIMITS, MODEL, RESILIENCE, SECURITY, arg_group
from services.common.auth import InternalAuth, add_internal_auth_arguments
from services.common.limits import RequestLimits, add_limit_arguments

API_KEY_ENV = "TANDEM_API_KEY"


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000                     # 0 = pick a free port
    router: str = "127.0.0.1:50051"      # the router's gRPC address
    api_key: str | None = None           # None: no authentication
    tokenizer: str | None = None         # folder to load the tokenizer from (default: resolve the model id)
    max_inflight: int = 1024             # HTTP requests in flight beyond which new ones get 429 at once
    max_n: int = 16                      # the largest `n` (choices per prompt) a request may ask for
    request_timeout_s: float = 600.0     # gRPC deadline of one generation; 0 = none
    models_ttl_s: float = 5.0            # how long a ListModels answer is trusted
    drain_timeout_s: float = 5.0
    auth: InternalAuth = field(default_factory=InternalAuth, repr=False)  # what the router accepts from us
    limits: RequestLimits = RequestLimits()

    def validate(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_inflight < 1 or self.max_n < 1:
            raise ValueError("--max-inflight and --max-n must be >= 1")
        if self.request_timeout_s < 0 or self.models_ttl_s < 0 or self.drain_timeout_s < 0:
            raise ValueError("timeouts must be >= 0")
        if self.api_key == "":
            raise ValueError("--api-key must not be empty")

    @property
    def http_addr(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewayConfig:
        # The one place the gateway reads the environment: a key in argv would show in `ps`.
        api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
        config = cls(
            host=args.host, port=args.port, router=args.router, api_key=api_key, tokenizer=args.tokenizer,
            max_inflight=args.max_inflight, max_n=args.max_n, request_timeout_s=args.request_timeout,
            drain_timeout_s=args.drain_timeout, auth=InternalAuth.load(args.internal_token_file),
            limits=RequestLimits.from_args(args),
        )
        config.validate()
        return config


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = GatewayConfig()
    where = arg_group(p, DEPLOYMENT)
    where.add_argument("--host", default=d.host, help="address to listen on")
    where.add_argument("--port", type=int, default=d.port, help="HTTP port (0 = pick a free one)")
    where.add_argument("--router", default=d.router, help="the router's gRPC address host:port")
    arg_group(p, MODEL).add_argument(
        "--tokenizer", default=None,
        help="model folder to load the tokenizer (and generation_config.json) from (default: resolve the "
             "served model id)")
    arg_group(p, SECURITY).add_argument(
        "--api-key", default=None,
        help=f"require `Authorization: Bearer KEY` (default: ${API_KEY_ENV}; unset = no auth)")
    limits = arg_group(p, LIMITS)
    limits.add_argument("--max-inflight", type=int, default=d.max_inflight,
                        help="requests in flight beyond which new ones get HTTP 429 at once")
    limits.add_argument("--max-n", type=int, default=d.max_n, help="the largest `n` a request may ask for")
    timeouts = arg_group(p, RESILIENCE)
    timeouts.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                          help="seconds per generation (0 = none)")
    timeouts.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s,
                          help="seconds to let in-flight requests finish on SIGTERM")
    add_internal_auth_arguments(p)
    add_limit_arguments(p)
