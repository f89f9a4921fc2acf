"""CPU placement: core-list parsing and how `tandem up` splits cores (pure functions)."""

from __future__ import annotations

import os

import pytest

from tandem.services.common.cpu_cores import (
    CorePlan,
    CpuListError,
    assign_cores,
    describe,
    format_cpu_list,
    parse_cpu_list,
    parse_worker_cores,
    pin,
    plan_cores,
)


@pytest.mark.parametrize("text, cores", [
    ("0", (0,)), ("0-1", (0, 1)), ("0,2", (0, 2)), (" 4-5, 0 ,2", (0, 2, 4, 5)), ("1,1,0-1", (0, 1)),
    ("3-3", (3,)),
])
def test_parse_cpu_list(text, cores):
    assert parse_cpu_list(text) == cores
    assert parse_cpu_list(format_cpu_list(cores)) == cores


@pytest.mark.parametrize("text, message", [
    ("", "empty core list"), ("a", "'a' is not a core number"), ("3-1", "'3-1' ends before it starts"),
    ("-1", "'-1' is not a core number"), ("0,,1", "'' is not a core number"), ("1-", "'1-' is not"),
    ("0-2-4", "'0-2-4' is not"), ("1.5", "'1.5' is not"), ("99999999", "is not a core number"),
])
def test_bad_core_lists_say_what_is_wrong(text, message):
    with pytest.raises(CpuListError) as e:
        parse_cpu_list(text)
    assert message in str(e.value)


def test_worker_flag_turns_pinning_off_with_none_or_nobind():
    assert parse_worker_cores("none") is None and parse_worker_cores("NoBind") is None
    assert parse_worker_cores("0-1") == (0, 1)


def test_format_cpu_list_merges_runs():
    assert format_cpu_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"


@pytest.mark.parametrize("n, workers, shares, services", [
    (2, 2, [(0,), (1,)], None),                     # 1P1D on 2 cores: prefill 0, decode 1
    (2, 1, [(0, 1)], None),                         # co-located gets all cores
    (1, 1, [(0,)], None),
    (3, 2, [(0,), (1,)], (2,)),                     # a core more than workers: the services' own
    (3, 1, [(0, 1)], (2,)),
    (3, 3, [(0,), (1,), (2,)], None),
    (4, 2, [(0, 1), (2,)], (3,)),
    (8, 2, [(0, 1, 2, 3), (4, 5, 6)], (7,)),
    (8, 3, [(0, 1, 2), (3, 4), (5, 6)], (7,)),
])
def test_each_worker_gets_its_own_cores(n, workers, shares, services):
    plan = assign_cores(range(n), workers)
    assert plan == CorePlan(tuple(shares), services)
    used = [c for s in plan.workers for c in s]
    assert len(used) == len(set(used)), "shares overlap"
    assert not set(used) & set(plan.services or ())


def test_more_workers_than_cores_share_round_robin():
    plan = assign_cores([0, 1], 3)
    assert plan.workers == ((0,), (1,), (0,)) and plan.shared and plan.services is None


def test_assign_uses_the_given_cores_not_0_to_n():
    assert assign_cores([4, 6], 2).workers == ((4,), (6,))


def test_plan_cores_specs():
    assert plan_cores("auto", (0, 1), 2).workers == ((0,), (1,))
    off = plan_cores("none", (0, 1), 2)
    assert off.workers == (None, None) and not off.pinned
    assert plan_cores("nobind", (0, 1), 1).workers == (None,)
    assert plan_cores("1-3", (0, 1, 2, 3), 2) == CorePlan(((1,), (2,)), (3,))
    explicit = plan_cores("0|1-2", (0, 1, 2, 3), 2)
    assert explicit == CorePlan(((0,), (1, 2)), (3,))
    assert plan_cores("0|1", (0, 1), 2).services is None


def test_plan_cores_errors_are_clear():
    with pytest.raises(CpuListError, match=r"gives 3 core lists for 2 worker\(s\)"):
        plan_cores("0|1|0", (0, 1), 2)
    with pytest.raises(CpuListError, match=r"core\(s\) 2-6 not available to this process \(available: 0-1\)"):
        plan_cores("0-6", (0, 1), 2)
    with pytest.raises(CpuListError, match=r"core\(s\) 2 not available"):
        plan_cores("0|2", (0, 1), 2)
    with pytest.raises(CpuListError, match="ends before it starts"):
        plan_cores("2-0", (0, 1, 2), 1)


def test_describe_is_one_line_for_the_banner():
    names = ["prefill-0", "decode-0"]
    assert describe(assign_cores([0, 1], 2), names) == "prefill-0 core 0, decode-0 core 1; gateway/router/Redis unpinned"
    assert describe(assign_cores(range(8), 2), names) == \
        "prefill-0 cores 0-3, decode-0 cores 4-6; gateway/router/Redis core 7"
    assert "not pinned" in describe(plan_cores("none", (0, 1), 2), names)
    assert "shared" in describe(assign_cores([0], 2), names)


def test_services_yield_only_while_they_share_the_workers_cores():
    names = ["prefill-0", "decode-0"]
    shared, own = assign_cores([0, 1], 2), assign_cores(range(8), 2)
    assert shared.services_nice(10) == 10 and own.services_nice(10) == 0
    assert plan_cores("none", (0, 1), 2).services_nice(7) == 7
    assert describe(shared, names, 10) == "prefill-0 core 0, decode-0 core 1; gateway/router/Redis unpinned, nice 10"
    assert describe(plan_cores("none", (0, 1), 2), names, 5).endswith("gateway/router/Redis, nice 5")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_pin_refuses_cores_the_kernel_does_not_allow():
    with pytest.raises(CpuListError, match="cannot pin|not available"):
        pin((1 << 15,))
