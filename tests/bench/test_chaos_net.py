"""bench/chaos_net.py's accounting (torch-free, no namespaces): what counts as wrong, hung, failed,
and when a phase recovered."""

from __future__ import annotations

import pytest

from tandem.bench import chaos_net


def r(start: float, kind: str, wrong: bool = False, message: str = "") -> dict:
    return {"start": start, "end": start + 0.5, "kind": kind, "wrong": wrong, "message": message}


def test_summary_counts_wrong_answers_apart_from_ok_and_recovery_waits_for_them():
    results = [r(0, "ok"), r(1, "ok"), r(6, "ok", wrong=True), r(7, "error", message="boom"), r(8, "hung"),
               r(9, "ok"), r(10, "ok")]
    row = chaos_net.summarize("x", results, event_at=5.0, kv={"decode-0": {"free": 10, "total": 12}, "p": None}, extra={})
    assert (row["sent"], row["ok"], row["wrong"], row["failed"], row["hung"]) == (7, 4, 1, 1, 1)
    assert row["recovery_s"] == 4.0            # from the event to the first of the all-good tail
    assert row["pages_leaked"] == 2 and row["workers_unreadable"] == ["p"]
    assert row["error_samples"] == ["boom"]


def test_long_prompts_are_about_two_thousand_tokens_and_distinct():
    long = chaos_net.prompts(long=True)
    assert len(set(long)) == len(long) == 8
    assert all(1500 <= len(p.split()) <= 1600 for p in long)


def test_unknown_scenarios_are_refused():
    with pytest.raises(SystemExit):
        chaos_net.main(["--scenarios", "baseline,meteor"])
