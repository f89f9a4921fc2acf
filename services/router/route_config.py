"""How the router weighs cache, load and local prefill: one frozen dataclass and its flags (which
`tandem up` takes too and forwards when set)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from tandem.services.common.arg_groups import ROUTING
from tandem.services.common.flags import Flag, Owner

# Measured (docs/benchmarks.md, "KV-aware routing"): under long-prompt load a prompt of up to 1,024
# tokens got its first token sooner from the decode worker's own mixed-chunk prefill than through a
# prefill worker (the crossover lies beyond; Dynamo's max_local_prefill_length is 1,000).
DEFAULT_LOCAL_PREFILL_MAX_TOKENS = 1024
# Decode-only fallback: with no prefill worker to take it, a prompt up to this long is prefilled on its
# decode worker (as Dynamo does) rather than failed. A decode worker's mixed chunks prefill it at full
# prompt speed; what bounds it is how long its running streams stall behind the chunks.
DEFAULT_FALLBACK_LOCAL_PREFILL_MAX_TOKENS = 8192
# The serving benchmarks' TPOT SLO (tandem bench sweep): a local prefill that would push D's running
# requests past it goes to a prefill worker instead.
DEFAULT_LOCAL_PREFILL_MAX_ITL_MS = 150.0
KV_REUSE_POLICIES = ("auto", "always", "never")
# aware: an adapter's request prefers the workers that have it loaded (services/router/lora_routing.py);
# blind: LoRA plays no part in the pick (the baseline bench/lora_routing.py compares it with).
LORA_ROUTING = ("aware", "blind")


@dataclass(frozen=True)
class RouteConfig:
    local_prefill_max_tokens: int = DEFAULT_LOCAL_PREFILL_MAX_TOKENS  # -1: never prefill on D by size
    max_prefill_queue_tokens: int = 16384   # a prefill worker with more queued is saturated; 0: never
    balance_abs_threshold: int = 32         # cache_aware: load gap (requests) that overrides the cache ...
    balance_rel_threshold: float = 1.5      # ... when the busiest also has this many times the idlest's
    prefix_cache_ttl_s: float = 300.0       # the router forgets a routed prefix this long after its last use
    fallback: bool = True                   # no prefill worker can take a prompt: its decode worker prefills it
    fallback_local_prefill_max_tokens: int = DEFAULT_FALLBACK_LOCAL_PREFILL_MAX_TOKENS   # -1: any length
    # A decode worker prefills a prompt itself only if the inter-token latency its running requests
    # would then see stays within this (0: no bound): a local prefill must not break the TPOT SLO of
    # everything D decodes (docs/benchmarks.md, "Capacity at SLO").
    local_prefill_max_itl_ms: float = DEFAULT_LOCAL_PREFILL_MAX_ITL_MS
    # KV both ways (cost.py `reuse_tokens`): "auto" fetches what D holds beyond P's cache when that is
    # cheaper than computing it, "always" whenever D holds more, "never" computes it.
    kv_reuse_policy: str = "auto"
    kv_link_gbps: float = 10.0              # the P-D link the cost model assumes until P has measured a fetch
    lora_routing: str = "aware"             # LORA_ROUTING

    def validate(self) -> None:
        if self.local_prefill_max_tokens < -1:
            raise ValueError(f"--local-prefill-max-tokens must be >= -1, got {self.local_prefill_max_tokens}")
        if self.max_prefill_queue_tokens < 0:
            raise ValueError(f"--max-prefill-queue-tokens must be >= 0, got {self.max_prefill_queue_tokens}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("--balance-abs-threshold must be >= 0 and --balance-rel-threshold >= 1")
        if self.fallback_local_prefill_max_tokens < -1 or self.fallback_local_prefill_max_tokens == 0:
            raise ValueError("--fallback-local-prefill-max-tokens must be > 0 or -1 (any length); "
                             f"got {self.fallback_local_prefill_max_tokens} (--no-fallback turns the fallback off)")
        if self.local_prefill_max_itl_ms < 0:
            raise ValueError(f"--local-prefill-max-itl-ms must be >= 0, got {self.local_prefill_max_itl_ms}")
        if self.kv_reuse_policy not in KV_REUSE_POLICIES:
            raise ValueError(f"--kv-reuse-policy must be one of {', '.join(KV_REUSE_POLICIES)}, "
                             f"got {self.kv_reuse_policy!r}")
        if self.lora_routing not in LORA_ROUTING:
            raise ValueError(f"--lora-routing must be one of {', '.join(LORA_ROUTING)}, got {self.lora_routing!r}")
        if self.kv_link_gbps <= 0:
            raise ValueError(f"--kv-link-gbps must be > 0, got {self.kv_link_gbps}")
        if self.prefix_cache_ttl_s <= 0:
            raise ValueError(f"--prefix-cache-ttl must be > 0, got {self.prefix_cache_ttl_s}")


ROUTE_FLAGS = tuple(
    Flag((name,), Owner.ROUTER, ROUTING, text, field=f"route.{field}", type=kind)
    for name, field, kind, text in (
        ("--local-prefill-max-tokens", "local_prefill_max_tokens", int,
         "disagg: a prompt whose part not cached on its decode worker is at most this many tokens is prefilled "
         "there (mixed chunks) instead of on a prefill worker; 0: only fully cached prompts, -1: never by size"),
        ("--local-prefill-max-itl-ms", "local_prefill_max_itl_ms", float,
         "disagg: a decode worker prefills a prompt itself (either rule above) only if the inter-token latency of "
         "the requests it is decoding would stay within this many ms, by its reported step costs (0: no bound)"),
        ("--max-prefill-queue-tokens", "max_prefill_queue_tokens", int,
         "disagg: a prefill worker with more prompt tokens than this queued is saturated; when all are, a prompt "
         "is prefilled on its decode worker if that is sooner (0: never saturated)"),
        ("--balance-abs-threshold", "balance_abs_threshold", int,
         "cache_aware: when the busiest worker has more than this many requests over the idlest (and "
         "--balance-rel-threshold times as many), pick by load, not cache"),
        ("--balance-rel-threshold", "balance_rel_threshold", float,
         "cache_aware: ... and more than this many times the idlest's requests"),
        ("--prefix-cache-ttl", "prefix_cache_ttl_s", float,
         "seconds after its last use that the router stops counting a routed prefix as cached on a worker"),
        ("--kv-link-gbps", "kv_link_gbps", float,
         "disagg, --kv-reuse-policy auto: the prefill-decode link bandwidth (Gbit/s) the cost model assumes "
         "until a prefill worker has measured its own fetches"),
        ("--fallback-local-prefill-max-tokens", "fallback_local_prefill_max_tokens", int,
         "disagg, decode-only fallback: when no prefill worker can take a prompt (none registered, every one "
         "failed or its circuit open), a prompt up to this many tokens is prefilled on its decode worker "
         "instead of failing (-1: any length)"),
    )) + (
    Flag(("--fallback",), Owner.ROUTER, ROUTING,
         "disagg: fall back to the decode worker's own prefill when no prefill worker can take a prompt "
         "(counted in tandem_router_fallbacks_total, traced as tandem.route.fallback)",
         field="route.fallback", action="on_off", off=("--no-fallback",),
         off_help="fail a request with UNAVAILABLE when no prefill worker can take it (fail fast)"),
    Flag(("--kv-reuse-policy",), Owner.ROUTER, ROUTING,
         "disagg, KV both ways: when the decode worker holds more of a prompt than its prefill worker (in a "
         "multi-turn conversation, the earlier answers), the prefill worker fetches that KV from it instead of "
         "computing it: auto when the cost model finds the fetch cheaper (--kv-link-gbps), always, or never "
         "(workers: --kv-reuse-from-decode)", field="route.kv_reuse_policy", choices=KV_REUSE_POLICIES),
    Flag(("--lora-routing",), Owner.ROUTER, ROUTING,
         "LoRA adapters: aware sends an adapter's request to the workers that have it loaded unless they are "
         "much busier (--balance-*-threshold), so adapters are read from disk less often; blind picks among "
         "every worker that serves it as for the base model", field="route.lora_routing", choices=LORA_ROUTING),
)


def route_config_from_args(args: argparse.Namespace) -> RouteConfig:
    cfg = RouteConfig(
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        local_prefill_max_itl_ms=args.local_prefill_max_itl_ms,
        max_prefill_queue_tokens=args.max_prefill_queue_tokens,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        prefix_cache_ttl_s=args.prefix_cache_ttl,
        fallback=RouteConfig.fallback if args.fallback is None else args.fallback,
        fallback_local_prefill_max_tokens=args.fallback_local_prefill_max_tokens,
        kv_reuse_policy=args.kv_reuse_policy, kv_link_gbps=args.kv_link_gbps, lora_routing=args.lora_routing,
    )
    cfg.validate()
    return cfg

