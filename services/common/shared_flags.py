"""The flags several processes take, declared once (services/common/flags.py). Each owner's default
comes from its own config: `tandem router --drain-timeout` defaults to RouterConfig.drain_timeout_s,
`tandem prefill --drain-timeout` to WorkerConfig's."""

from __future__ import annotations

from tandem.services.common.arg_groups import (
            DEPLOYMENT,
            LIMITS,
            LORA,
            MODEL,
            OBSERVABILITY,
            RESILIENCE,
            SCHEDULER,
)
from tandem.services.common.flags import SERVICES, Flag, Owner

HOST = Flag(("--host",), SERVICES | Owner.PLANNER, DEPLOYMENT, "address to listen on (`tandem up`: every service's)",
            field="host")
PORT = Flag(("--port",), SERVICES | Owner.LAUNCHER, DEPLOYMENT,
            "port to listen on, 0: any free one (gRPC on workers and the router, HTTP on the gateway; "
            "`tandem up`: the router's)", field="port", type=int, up=Owner.LAUNCHER)
REDIS_URL = Flag(("--redis-url",), Owner.WORKER | Owner.ROUTER | Owner.GATEWAY | Owner.LAUNCHER | Owner.PLANNER,
                 DEPLOYMENT,
                 "the Redis registry workers announce themselves in and the router finds them in (the gateway: "
                 "where the Responses API keeps responses; default there: its own memory), e.g. "
                 "redis://127.0.0.1:6379/0 or unix:///path/redis.sock (`tandem up`: default: an embedded one)",
                 field="redis_url", up=Owner.LAUNCHER)
METRICS_PORT = Flag(("--metrics-port",), Owner.WORKER | Owner.ROUTER | Owner.PLANNER, OBSERVABILITY,
                    "Prometheus /metrics port (0: any free port, -1: off)", field="metrics_port", type=int,
                    up=Owner.NONE)
# `tandem up --drain-timeout` is the workers' (their owed KV transfers are what a drain waits for);
# its router and gateway keep their own.
DRAIN_TIMEOUT = Flag(("--drain-timeout",), SERVICES, RESILIENCE,
                     "SIGTERM: seconds to let in-flight requests finish (a prefill worker: also the KV "
                     "transfers it owes) before exiting; keep it below the pod's terminationGracePeriodSeconds",
                     field="drain_timeout_s", type=float, metavar="SECONDS", up=Owner.WORKER)
REQUEST_TIMEOUT = Flag(("--request-timeout",), Owner.ROUTER | Owner.GATEWAY, RESILIENCE,
                       "seconds a generation may take: the deadline of its gRPC calls (0: none)",
                       field="request_timeout_s", type=float, metavar="SECONDS")
# `tandem up --max-inflight` is the router's: its admission refuses (the gateway keeps its own bound).
MAX_INFLIGHT = Flag(("--max-inflight",), Owner.ROUTER | Owner.GATEWAY, LIMITS,
                    "requests in flight beyond which new ones are refused at once (gRPC RESOURCE_EXHAUSTED, "
                    "HTTP 429)", field="max_inflight", type=int, up=Owner.ROUTER)
# The router knows a model only to report and match it; `tandem up` gives it to the workers.
MODEL_FLAG = Flag(("--model",), Owner.ENGINE | Owner.ROUTER, MODEL,
                  "the model: an alias (smollm2-135m) or a local Hugging Face folder (the router: the model id "
                  "of static workers that do not describe themselves, for ListModels; empty: any)",
                  field="model", up=Owner.ENGINE)

# Queue flags of the workers' schedulers and of the router's admission queue.
QUEUE_FLAGS = (
    Flag(("--max-queued-requests",), Owner.ENGINE | Owner.ROUTER, SCHEDULER,
         "requests waiting to be served (workers: waiting for compute or, on decode, for KV pages; router: for "
         "an in-flight slot beyond --max-inflight, 0: none wait); when full, the one that would be served last "
         "(the newcomer unless it outranks someone) gets RESOURCE_EXHAUSTED / HTTP 429 at once",
         field="max_queued_requests", type=int),
    Flag(("--enable-priority-scheduling",), Owner.ENGINE | Owner.ROUTER, SCHEDULER,
         "serve queued requests by their `priority`, then arrival (default: arrival only)",
         field="enable_priority_scheduling", action="store_true"),
    Flag(("--low-priority-values-first",), Owner.ENGINE | Owner.ROUTER, SCHEDULER,
         "a lower `priority` value is more urgent (default: a higher one), as SGLang's "
         "--schedule-low-priority-values-first", field="low_priority_values_first", action="store_true"),
)

# The workers accept runtime loads only with it; the gateway serves the endpoints only with it.
LORA_RUNTIME_UPDATING = Flag(
    ("--enable-lora-runtime-updating",), Owner.ENGINE | Owner.GATEWAY, LORA,
    "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with the API key when one is set): adapters "
    "loaded and unloaded on every worker while serving (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; default: off)",
    field="enable_lora_runtime_updating", action="store_true")

LOG_LEVEL = Flag(("--log-level",), Owner.LAUNCHER | Owner.ENGINE | SERVICES, OBSERVABILITY,
                 "Python logging level of this process: DEBUG, INFO, WARNING, ERROR", default="WARNING",
                 up=Owner.NONE)
OTLP_TRACES_ENDPOINT = Flag(("--otlp-traces-endpoint",), SERVICES, OBSERVABILITY,
                            "export OpenTelemetry traces of every request: an OTLP/gRPC collector "
                            "(http://host:4317) or a file of JSON lines (file:///path/traces.jsonl, which "
                            "`tandem trace` reads); unset: the OTEL_* variables decide, by default off "
                            "(docs/observability.md#tracing)", default="", metavar="URL")
