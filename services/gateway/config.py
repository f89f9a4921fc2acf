"""Gateway configuration: one frozen dataclass, built from the command line in one place."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from tandem.services.common.arg_groups import DEPLOYMENT, LIMITS, MODEL
from tandem.services.common.auth import API_KEY, INTERNAL_TOKEN_FILE, InternalAuth, load_api_key
from tandem.services.common.flags import Flag, Owner, add_flags
from tandem.services.common.limits import LIMIT_FLAGS, RequestLimits
from tandem.services.common.shared_flags import (
    DRAIN_TIMEOUT,
    HOST,
    LORA_RUNTIME_UPDATING,
    MAX_INFLIGHT,
    OTLP_TRACES_ENDPOINT,
    PORT,
    REDIS_URL,
    REQUEST_TIMEOUT,
)
from tandem.services.gateway.reasoning import PARSERS
from tandem.services.gateway.tool_formats import TOOL_PARSERS


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
    reasoning_parser: str | None = None  # splits thinking from the answer in chat (services/gateway/reasoning.py)
    tool_call_parser: str = "hermes"     # the format `auto` tool calls are read in (services/gateway/tool_formats.py)
    redis_url: str | None = None         # the Responses API's store (response_store.py); None: this process's memory
    response_store_size: int = 10000     # the most responses kept (the oldest are evicted first)
    response_store_ttl_s: float = 3600.0 # how long a response is kept
    enable_lora_runtime_updating: bool = False   # POST /v1/load_lora_adapter, /v1/unload_lora_adapter

    def validate(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_inflight < 1 or self.max_n < 1:
            raise ValueError("--max-inflight and --max-n must be >= 1")
        if self.request_timeout_s < 0 or self.models_ttl_s < 0 or self.drain_timeout_s < 0:
            raise ValueError("timeouts must be >= 0")
        if self.api_key == "":
            raise ValueError("--api-key must not be empty")
        if self.response_store_size < 1 or self.response_store_ttl_s <= 0:
            raise ValueError("--response-store-size must be >= 1 and --response-store-ttl > 0")
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(PARSERS)}, got {self.reasoning_parser!r}")

    @property
    def http_addr(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewayConfig:
        config = cls(
            host=args.host, port=args.port, router=args.router, api_key=load_api_key(args.api_key),
            tokenizer=args.tokenizer,
            max_inflight=args.max_inflight, max_n=args.max_n, request_timeout_s=args.request_timeout,
            drain_timeout_s=args.drain_timeout, auth=InternalAuth.load(args.internal_token_file),
            limits=RequestLimits.from_args(args), reasoning_parser=args.reasoning_parser,
            tool_call_parser=args.tool_call_parser,
            redis_url=args.redis_url or None, response_store_size=args.response_store_size,
            response_store_ttl_s=args.response_store_ttl,
            enable_lora_runtime_updating=args.enable_lora_runtime_updating,
        )
        config.validate()
        return config


GATEWAY_FLAGS = (
    HOST, PORT,
    Flag(("--router",), Owner.GATEWAY, DEPLOYMENT, "the router's gRPC address host:port", field="router",
         up=Owner.NONE),
    Flag(("--tokenizer",), Owner.GATEWAY, MODEL,
         "model folder to load the tokenizer (and generation_config.json) from (default: resolve the served "
         "model id)", field="tokenizer"),
    Flag(("--reasoning-parser",), Owner.GATEWAY, MODEL,
         "split a thinking model's reasoning from its answer in chat completions (`reasoning_content`, streamed as "
         "deltas); tool calls are read from the answer only (vLLM's names; default: off)",
         field="reasoning_parser", choices=PARSERS),
    Flag(("--tool-call-parser",), Owner.GATEWAY, MODEL,
         "the format the model writes tool calls in, read back into `tool_calls` when tool_choice is auto (vLLM's "
         "names; a required or named call is written by the grammar and read as hermes whatever this says)",
         field="tool_call_parser", choices=tuple(TOOL_PARSERS)),
    API_KEY, MAX_INFLIGHT, REDIS_URL,
    Flag(("--response-store-size",), Owner.GATEWAY, LIMITS,
         "the most Responses API responses kept for previous_response_id / GET (oldest evicted first)",
         field="response_store_size", type=int),
    Flag(("--response-store-ttl",), Owner.GATEWAY, LIMITS,
         "seconds a Responses API response is kept for previous_response_id / GET",
         field="response_store_ttl_s", type=float, metavar="SECONDS"),
    Flag(("--max-n",), Owner.GATEWAY, LIMITS, "the largest `n` a request may ask for", field="max_n", type=int),
    REQUEST_TIMEOUT, DRAIN_TIMEOUT, INTERNAL_TOKEN_FILE, *LIMIT_FLAGS, OTLP_TRACES_ENDPOINT, LORA_RUNTIME_UPDATING,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, GATEWAY_FLAGS, {Owner.GATEWAY: GatewayConfig()})
