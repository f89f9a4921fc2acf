"""`tandem up`'s own config and flags: which processes it starts and where. Its children's flags are
theirs (the engine's, a worker's, the router's, the gateway's); `tandem up` takes those too and
forwards what the user set (tandem/up_cmd.py)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.services.common.arg_groups import DEPLOYMENT, OBSERVABILITY, RESILIENCE
from tandem.services.common.auth import API_KEY
from tandem.services.common.flags import Flag, Owner
from tandem.services.common.shared_flags import HOST, PORT, REDIS_URL
from tandem.services.router.config import MODE


@dataclass(frozen=True)
class UpConfig:
    mode: str = "disagg"                 # disagg | colocated
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 1               # co-located workers (data-parallel replicas; --mode colocated)
    host: str = "127.0.0.1"
    port: int = 50051                    # router's public gRPC port (0: any free port)
    redis_url: str | None = None         # None: embedded redis-server
    worker_args: tuple[str, ...] = ()    # the flags every worker gets (forwarded from `tandem up`'s)
    router_args: tuple[str, ...] = ()
    ready_timeout_s: float = 600.0       # first run imports the default model
    quiet: bool = False                  # no banner, no progress, services log warnings and errors only
    ready_json: bool = False             # print READY_JSON_PREFIX + summary JSON on stdout once up
    stop_grace_s: float = 20.0           # SIGTERM -> SIGKILL; above the workers' drain timeout
    gateway_port: int = 8000             # OpenAI-compatible HTTP gateway (0: any free port, -1: none)
    gateway_args: tuple[str, ...] = ()
    api_key: str | None = None           # the gateway's key (passed in its environment, not its argv)
    cpu_cores: str = "auto"              # auto | none | a core list to split | one list per worker, '|'-separated
    services_nice: int = 10              # gateway/router/Redis niceness while they share the workers' cores
    max_restarts: int = 20               # per process; 0: nothing is restarted (a dead router/gateway stops all)
    internal_token_file: str | None = None  # None: $TANDEM_INTERNAL_TOKEN, else a fresh secret in the children's env
    planner: bool = False                # also start `tandem planner --planner-target host` (supervised)
    planner_args: tuple[str, ...] = ()   # the planner's flags the user set (forwarded)


def _count(role: str, *aliases: str, what: str) -> Flag:
    # A homonym of the router's static address lists (tests/tandem/test_flags.py).
    return Flag((f"--{role}", *aliases), Owner.LAUNCHER, DEPLOYMENT, what, field=f"num_{role}", type=int,
                dest=role, metavar="N")


_L = Owner.LAUNCHER
LAUNCHER_FLAGS = (
    MODE,
    _count("prefill", what="prefill workers (disagg)"),
    _count("decode", what="decode workers (disagg)"),
    _count("colocated", "--dp-size",
           what="co-located workers (colocated): N data-parallel replicas, each with its own share of the cores, "
                "behind the router (like SGLang's --dp-size)"),
    HOST, PORT,
    Flag(("--gateway-port",), _L, DEPLOYMENT,
         "OpenAI-compatible HTTP gateway's port (0: any free port, -1: no gateway)", field="gateway_port", type=int),
    REDIS_URL,
    Flag(("--cpu-cores",), _L, DEPLOYMENT,
         "CPU placement. auto: give each worker its own share of the cores this process may use (prefill workers "
         "first; gateway/router/Redis get a core of their own when there are more cores than workers and at least "
         "3); a core list (0-7): split those instead; one list per worker separated by '|' (0-3|4-7, like "
         "VLLM_CPU_OMP_THREADS_BIND); none or nobind: no pinning. A pinned worker runs one torch thread per core "
         "unless --num-threads is given", field="cpu_cores", metavar="SPEC"),
    Flag(("--services-nice",), _L, DEPLOYMENT,
         "the niceness (0-19) of the gateway, the router and the embedded Redis when they have no core of their "
         "own (--cpu-cores gives them none on a machine with fewer than 3 cores, or as many workers): a request's "
         "control path then yields the CPU to the model's forward passes instead of preempting a prefill "
         "midway; 0: the workers' priority", field="services_nice", type=int, metavar="N"),
    Flag(("--max-restarts",), _L, RESILIENCE,
         "restart a worker, the router, the gateway or the embedded Redis that dies, at most N times each "
         "(exponential backoff from 0.5s; each restart is logged with the exit status); 0: never (a dead router "
         "or gateway then stops everything)", field="max_restarts", type=int, metavar="N"),
    API_KEY,
    Flag(("--planner",), _L, DEPLOYMENT,
         "also run the SLO planner (`tandem planner --planner-target host`, supervised): it reshapes the "
         "deployment live, moving workers between prefill and decode on their cores (`tandem reshape` does it "
         "by hand at any time); the router then serves with no prefill worker too (--min-prefill-workers 0 "
         "unless given)", field="planner", action="store_true"),
    Flag(("--quiet",), _L, OBSERVABILITY,
         "no banner and no service INFO logs: only the services' readiness lines, warnings and errors", field="quiet",
         action="store_true"),
    Flag(("--ready-json",), _L, OBSERVABILITY,
         "once everything is ready, print one line `TANDEM_UP {json}` on stdout (addresses of router, gateway, "
         "workers, metrics ports): for scripts and tests", field="ready_json", action="store_true"),
)
