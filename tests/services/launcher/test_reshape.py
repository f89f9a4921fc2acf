"""The launcher's reshape state machine (services/launcher/reshape.py) on fake workers: one slot at a
time, drain (SIGTERM, never restarted) -> start the new role on the same cores under a new name ->
serving once READY; the least loaded worker moves; shapes that do not fit are refused; the state it
publishes says what runs."""

from __future__ import annotations

import itertools

import pytest

from tandem.services.launcher.reshape import Reshaper, Slot
from tandem.services.launcher.supervisor import Supervisor
from tandem.services.planner.host import HostActuator, ShapeStore
from tandem.services.planner.shape import Shape

_pids = itertools.count(1000)


class FakeProc:
    def __init__(self):
        self.pid = next(_pids)
        self.returncode: int | None = None


class FakeChild:
    def __init__(self, name: str, argv: list[str], env=None, on_line=None):
        self.name, self.argv, self.env, self.on_line = name, argv, env, on_line
        self.proc: FakeProc | None = None
        self.ready: dict | None = None
        self.signals: list[str] = []

    def start(self) -> None:
        self.proc = FakeProc()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def terminate(self) -> None:
        self.signals.append("TERM")

    def kill(self) -> None:
        self.signals.append("KILL")
        self.exit(-9)

    def exit(self, code: int = 0) -> None:
        self.proc.returncode = code

    def become_ready(self) -> None:
        self.ready = {"pid": self.proc.pid, "metrics_port": -1}


class FakeRedis:
    def __init__(self):
        self.kv: dict[str, str] = {}

    def incr(self, key):
        self.kv[key] = str(int(self.kv.get(key, 0)) + 1)
        return int(self.kv[key])

    def set(self, key, value):
        self.kv[key] = value

    def get(self, key):
        return self.kv.get(key)

    def close(self):
        pass


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def deployment(roles: list[str], loads: dict[str, float] | None = None, allow_no_prefill: bool = True,
               drain_s: float = 30.0):
    """A Supervisor with one ready fake worker per role, the Reshaper over them, a fake Redis."""
    clock = Clock()
    sup = Supervisor(clock=clock)
    slots, started = [], []
    for i, role in enumerate(roles):
        name = f"{role}-{sum(r == role for r in roles[:i])}"
        child = FakeChild(name, [role])
        child.start()
        child.become_ready()
        sup.add(name, child, lambda: None)
        slots.append(Slot(i, (2 * i, 2 * i + 1), role, name))

    def make(role, name, cores):
        child = FakeChild(name, [role, "--cpu-cores", f"{cores[0]}-{cores[1]}"])
        started.append(child)
        return child

    redis = FakeRedis()
    loads = loads or {}
    shaper = Reshaper(sup, slots, make, drain_s=drain_s, allow_no_prefill=allow_no_prefill,
                      store=ShapeStore("unix:///fake", client=redis), load=lambda c: loads.get(c.name, 0.0),
                      clock=clock)
    return shaper, sup, started, redis, clock


def test_prefill_slot_drains_then_restarts_as_decode_on_its_cores():
    shaper, sup, started, redis, clock = deployment(["prefill", "decode"])
    actuator = HostActuator("unix:///fake", client=redis)
    shaper.poll()
    assert actuator.current() == Shape(1, 1) and not actuator.busy()
    old = sup.entries["prefill-0"].child
    actuator.apply(Shape(0, 2), "test")
    assert actuator.busy()          # asked, not read yet
    shaper.poll()
    assert old.signals == ["TERM"] and "prefill-0" not in sup.entries   # retired: never restarted
    assert actuator.busy() and shaper.snapshot()["slots"][0]["state"] == "draining"
    clock.t += 3
    sup.poll()
    shaper.poll()
    assert not started                                   # nothing starts on its cores while it drains
    old.exit(0)
    sup.poll()
    shaper.poll()
    assert sup.stopped == [] and sup.gave_up == []       # its exit is none of the supervisor's business
    [new] = started
    assert new.name == "decode-1" and new.argv == ["decode", "--cpu-cores", "0-1"] and new.alive
    assert sup.entries["decode-1"].child is new
    assert actuator.busy()
    new.become_ready()
    shaper.poll()
    shaper.poll()
    state = redis.get("tandem:shape:state")
    assert actuator.current() == Shape(0, 2) and not actuator.busy(), state
    snap = shaper.snapshot()
    assert snap["seq"] == 1 and snap["error"] is None
    assert [(s["role"], s["name"], s["cores"], s["state"]) for s in snap["slots"]] == [
        ("decode", "decode-1", "0-1", "serving"), ("decode", "decode-0", "2-3", "serving")]
    assert shaper.children() == [new, sup.entries["decode-0"].child]


def test_the_least_loaded_decode_worker_moves_and_names_are_never_reused():
    shaper, sup, started, _, clock = deployment(["prefill", "decode", "decode"],
                                                loads={"decode-0": 5.0, "decode-1": 1.0})
    shaper.request("2P1D", seq=1)
    shaper.poll()
    victim = [s for s in shaper.slots if s.state == "draining"]
    assert [s.index for s in victim] == [2]              # decode-1: the least loaded
    assert shaper.children()[0].name == "decode-1"       # the draining one is still stopped at shutdown
    victim[0].retired.exit(0)
    shaper.poll()
    assert started[0].name == "prefill-1" and started[0].argv[-1] == "4-5"
    started[0].become_ready()
    shaper.poll()
    shaper.poll()
    assert shaper.shape() == Shape(2, 1) and not shaper.busy and shaper.applied == 1
    # Back: the least loaded prefill slot moves (ties: the first), under a name never used before.
    shaper.request("1P2D", seq=2)
    shaper.poll()
    assert shaper.slots[0].state == "draining"
    shaper.slots[0].retired.exit(0)
    shaper.poll()
    assert started[1].name == "decode-2"


def test_one_slot_at_a_time():
    shaper, sup, started, _, clock = deployment(["prefill", "prefill", "decode"])
    shaper.request(Shape(0, 3), seq=7, reason="test")
    shaper.poll()
    assert [s.state for s in shaper.slots] == ["draining", "serving", "serving"]
    shaper.slots[0].retired.exit(0)
    shaper.poll()
    assert [s.state for s in shaper.slots] == ["starting", "serving", "serving"]
    shaper.poll()
    assert [s.state for s in shaper.slots] == ["starting", "serving", "serving"]   # waits for READY
    assert sup.entries["prefill-1"].child.signals == []
    started[0].become_ready()
    shaper.poll()
    shaper.poll()
    assert [s.state for s in shaper.slots] == ["serving", "draining", "serving"]
    assert shaper.busy and shaper.applied == 0
    shaper.slots[1].retired.exit(0)
    shaper.poll()
    started[1].become_ready()
    shaper.poll()
    shaper.poll()
    assert shaper.shape() == Shape(0, 3) and shaper.applied == 7 and not shaper.busy


@pytest.mark.parametrize("shape,allow,why", [
    ("2P1D", True, "2P1D needs 3 workers, but this deployment has 2 worker slots"),
    ("0P2D", False, "0P2D has no prefill worker, and the router needs one (--min-prefill-workers"),
    ("1X", True, "a shape is written like 1P1D"),
])
def test_a_shape_that_does_not_fit_is_refused_and_nothing_moves(shape, allow, why):
    shaper, sup, started, redis, _ = deployment(["prefill", "decode"], allow_no_prefill=allow)
    redis.set("tandem:shape:desired", f'{{"shape": "{shape}", "seq": 4, "reason": "r"}}')
    shaper.poll()
    state = ShapeStore("unix:///fake", client=redis).state()
    assert state["error"]["seq"] == 4 and why in state["error"]["message"]
    assert state["seen"] == 4 and state["seq"] == 0 and not state["busy"] and state["shape"] == "1P1D"
    assert all(not e.child.signals for e in sup.entries.values()) and not started


def test_a_worker_that_does_not_drain_in_time_is_killed():
    shaper, _, started, _, clock = deployment(["prefill", "decode"], drain_s=10)
    shaper.request("0P2D", seq=1)
    shaper.poll()
    old = shaper.slots[0].retired
    clock.t += 5
    shaper.poll()
    assert old.signals == ["TERM"]
    clock.t += 6
    shaper.poll()
    assert old.signals == ["TERM", "KILL"]
    shaper.poll()
    assert started and started[0].name == "decode-1"


def test_a_new_worker_the_supervisor_gives_up_on_is_an_error():
    shaper, sup, started, _, clock = deployment(["prefill", "decode"])
    sup.max_restarts = 0
    shaper.request("0P2D", seq=3)
    shaper.poll()
    shaper.slots[0].retired.exit(0)
    shaper.poll()
    started[0].exit(1)     # dies before READY
    sup.poll()
    shaper.poll()
    assert shaper.error == {"seq": 3, "message": "decode-1 (new decode worker) did not start: the supervisor gave "
                                                 "up on it"}
    assert not shaper.busy


def test_the_latest_request_wins_once_the_moving_slot_has_landed():
    shaper, _, started, _, _ = deployment(["prefill", "decode", "decode"])
    shaper.request("0P3D", seq=1)
    shaper.poll()
    shaper.request("1P2D", seq=2)    # back to what runs, while prefill-0 drains
    shaper.slots[0].retired.exit(0)
    shaper.poll()
    started[0].become_ready()        # the moving slot lands as decode ...
    shaper.poll()
    shaper.poll()                    # ... then one decode slot moves back to prefill
    assert [s.state for s in shaper.slots].count("draining") == 1 and shaper.applied == 0


def test_the_last_move_is_timed():
    shaper, _, started, _, clock = deployment(["prefill", "decode"])
    shaper.request("0P2D", seq=1)
    shaper.poll()
    clock.t += 2.5
    shaper.slots[0].retired.exit(0)
    shaper.poll()
    clock.t += 4.0
    started[0].become_ready()
    shaper.poll()
    assert shaper.snapshot()["last_move"] == {"slot": 0, "from": "prefill-0", "to": "decode-1", "drain_s": 2.5,
                                              "start_s": 4.0}


def test_a_workers_load_is_read_from_its_metrics():
    import http.server
    import threading

    from tandem.services.launcher.reshape import worker_load

    body = (b'# HELP vllm:num_requests_running Requests running\nvllm:num_requests_running{model_name="m"} 2.0\n'
            b'vllm:num_requests_waiting{model_name="m"} 3.0\ntandem_other 9.0\n')

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        child = FakeChild("w", [])
        child.ready = {"metrics_port": server.server_port}
        assert worker_load(child) == 5.0
        child.ready = {"metrics_port": -1}
        assert worker_load(child) == float("inf")     # unknown: moved last
    finally:
        server.shutdown()


def test_requests_after_a_redis_restart_are_not_mistaken_for_old_ones():
    shaper, _, started, redis, _ = deployment(["prefill", "decode"])
    store = ShapeStore("unix:///fake", client=redis)
    assert store.request(Shape(1, 1), "a") == 1
    assert store.request(Shape(1, 1), "b") == 2
    shaper.poll()
    assert shaper.seen == 2
    redis.kv.clear()            # an embedded Redis came back empty ...
    shaper.poll()               # ... and the launcher wrote its state again
    assert store.request(Shape(0, 2), "after the restart") == 3
    shaper.poll()
    assert shaper.target == Shape(0, 2) and shaper.slots[0].state == "draining"
