"""The host actuator over a real Redis: `apply` writes the desired shape with a growing seq, `current`
and `busy` follow the launcher's state, and a stale state (no launcher) means busy with no shape."""

from __future__ import annotations

import json
import time

from tandem.services.planner.host import STALE_S, HostActuator, ShapeStore
from tandem.services.planner.shape import Shape
from tests.services.common.conftest import redis_url  # noqa: F401  (fixture)


def test_apply_current_and_busy_follow_the_launchers_state(redis_url):  # noqa: F811
    actuator = HostActuator(redis_url)
    launcher = ShapeStore(redis_url)
    try:
        assert actuator.current() is None and actuator.busy()          # no launcher has reported
        launcher.publish({"shape": "1P1D", "busy": False, "seq": 0, "seen": 0, "t": time.time()})
        assert actuator.current() == Shape(1, 1) and not actuator.busy()

        actuator.apply(Shape(0, 2), "ttft ok, itl over the SLO")
        desired = launcher.desired()
        assert desired == {"shape": "0P2D", "seq": 1, "reason": "ttft ok, itl over the SLO"}
        assert actuator.busy()                                          # not read yet
        launcher.publish({"shape": "1P1D", "busy": True, "seq": 0, "seen": 1, "t": time.time()})
        assert actuator.busy()
        launcher.publish({"shape": "0P2D", "busy": False, "seq": 1, "seen": 1, "t": time.time()})
        assert actuator.current() == Shape(0, 2) and not actuator.busy()

        assert launcher.request(Shape(1, 1), "operator") == 2          # anyone's request takes the next seq
        launcher.publish({"shape": "0P2D", "busy": False, "seq": 1, "seen": 1, "t": time.time() - STALE_S - 1})
        assert actuator.current() is None and actuator.busy()           # the launcher is gone
        assert json.loads(launcher.client.get("tandem:shape:desired"))["seq"] == 2
    finally:
        actuator.close()
        launcher.close()
