"""Acting on one host: the planner and `tandem reshape` ask `tandem up`'s launcher for a shape through
two Redis keys of the deployment's registry, and read back what it runs.

- `<prefix>:shape:desired`, written by `ShapeStore.request` (the `HostActuator`, `tandem reshape`):
  JSON {"shape": "0P2D", "seq": N, "reason": "..."}; `seq` comes from INCR `<prefix>:shape:seq`, so
  the latest request wins whoever wrote it, and a writer can tell when its own was applied.
- `<prefix>:shape:state`, written by the launcher (services/launcher/reshape.py) when anything
  changes and every few seconds: JSON {"shape", "target", "busy", "seq" (the last request applied),
  "seen" (the last request read), "error": {"seq", "message"} | null, "slots": [{"slot", "role",
  "name", "cores", "state", "pid"}], "last_move": {"slot", "from", "to", "drain_s", "start_s"} | null,
  "t" (wall clock)}.

Torch-free; the Redis client is built on first use.
"""

from __future__ import annotations

import json
import time

from tandem.services.planner.shape import Shape

PREFIX = "tandem"   # the registry's default prefix: `tandem up` runs everything on it
STALE_S = 15.0      # a state older than this: the launcher is gone


def desired_key(prefix: str = PREFIX) -> str:
    return f"{prefix}:shape:desired"


def state_key(prefix: str = PREFIX) -> str:
    return f"{prefix}:shape:state"


def seq_key(prefix: str = PREFIX) -> str:
    return f"{prefix}:shape:seq"


class ShapeStore:
    """The two keys, read and written with a synchronous client (`client`: injected in tests)."""

    def __init__(self, redis_url: str, prefix: str = PREFIX, client=None):
        self.redis_url = redis_url
        self.prefix = prefix
        self._client = client

    @property
    def client(self):
        if self._client is None:
            import redis

            self._client = redis.Redis.from_url(self.redis_url, socket_timeout=2.0, decode_responses=True)
        return self._client

    def request(self, shape: Shape, reason: str) -> int:
        """Ask for `shape`; returns the request's seq."""
        seq = int(self.client.incr(seq_key(self.prefix)))
        state = self.state()
        if state is not None and seq <= state.get("seen", 0):
            # Redis restarted (an embedded one keeps nothing): the counter starts over, the launcher has not.
            seq = int(state["seen"]) + 1
            self.client.set(seq_key(self.prefix), seq)
        self.client.set(desired_key(self.prefix),
                        json.dumps({"shape": str(shape), "seq": seq, "reason": reason}))
        return seq

    def desired(self) -> dict | None:
        raw = self.client.get(desired_key(self.prefix))
        return json.loads(raw) if raw else None

    def publish(self, state: dict) -> None:
        self.client.set(state_key(self.prefix), json.dumps(state))

    def state(self) -> dict | None:
        """The launcher's last report (None: no launcher has reported, or its report is stale)."""
        raw = self.client.get(state_key(self.prefix))
        if not raw:
            return None
        state = json.loads(raw)
        return state if time.time() - state.get("t", 0.0) <= STALE_S else None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class HostActuator:
    """The planner's actuator on one machine (services/planner/shape.py's `Actuator`): `apply` writes
    the desired shape and returns; the launcher moves one worker slot at a time and reports."""

    name = "host"

    def __init__(self, redis_url: str, prefix: str = PREFIX, client=None):
        self.store = ShapeStore(redis_url, prefix, client)
        self._asked = 0   # the seq of our last request

    def current(self) -> Shape | None:
        state = self.store.state()
        return Shape.parse(state["shape"]) if state and state.get("shape") else None

    def busy(self) -> bool:
        """Still applying (ours or anyone's request), or no launcher reports: nothing to decide on."""
        state = self.store.state()
        if state is None:
            return True
        return bool(state.get("busy")) or state.get("seen", 0) < self._asked   # not even read yet

    def apply(self, shape: Shape, reason: str) -> None:
        self._asked = self.store.request(shape, reason)

    def close(self) -> None:
        self.store.close()
