"""The planner benchmark's verdict and summary (bench/planner.py's results dict in, text out).

Targets (issue [19]), for each planner deployment against the fixed shapes measured on the same trace:
- overall goodput >= 1.25x the best fixed shape's;
- in every phase, goodput >= 0.9x the goodput of the fixed shape that is best in that phase;
- no failed request (a reshape must not fail any).
Goodput is requests that met the SLO per second of the profile (of the phase, per phase).
"""

from __future__ import annotations

OVERALL_TARGET = 1.25
PHASE_TARGET = 0.9


def verdict(results: dict) -> dict:
    """{"passed": bool | None (None: nothing to judge), "checks": [{"name", "passed", "detail"}...]}."""
    deps = results["deployments"]
    planners = [n for n, e in deps.items() if e.get("planner")]
    fixed = {n: e for n, e in deps.items() if not e.get("planner")}
    if not planners or not fixed:
        why = "no planner deployment was measured" if not planners else "no fixed shape was measured"
        return {"passed": None, "checks": [], "note": f"not judged: {why}"}
    checks = []
    best_name = max(fixed, key=lambda n: fixed[n]["metrics"]["goodput"])
    best = fixed[best_name]["metrics"]["goodput"]
    for name in planners:
        e = deps[name]
        good = e["metrics"]["goodput"]
        checks.append(_check(f"{name}: overall goodput", good >= OVERALL_TARGET * best,
                             f"{good:.3f} req/s = {_ratio(good, best)} the best fixed shape ({best_name}, "
                             f"{best:.3f}); target >= {OVERALL_TARGET}x"))
        for k, phase in enumerate(e["phases"]):
            rival = max(fixed, key=lambda n, k=k: fixed[n]["phases"][k]["metrics"]["goodput"])
            top = fixed[rival]["phases"][k]["metrics"]["goodput"]
            mine = phase["metrics"]["goodput"]
            checks.append(_check(f"{name}: phase {phase['name']} ({phase['spec']})", mine >= PHASE_TARGET * top,
                                 f"{mine:.3f} req/s = {_ratio(mine, top)} the best fixed shape there ({rival}, "
                                 f"{top:.3f}); target >= {PHASE_TARGET}x"))
        failed = e["metrics"]["failed"]
        failures = "; ".join(f"{n} x {m}" for m, n in e["metrics"].get("failures", {}).items())
        checks.append(_check(f"{name}: failed requests", failed == 0,
                             f"{failed} failed" + (f" ({failures})" if failures else "")))
    return {"passed": all(c["passed"] for c in checks), "checks": checks}


def _check(name: str, passed: bool, detail: str) -> dict:
    return {"name": name, "passed": bool(passed), "detail": detail}


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else ("inf x" if a > 0 else "1.00x (both 0)")


def format_summary(results: dict) -> str:
    """A table (goodput overall and per phase, failures, shapes seen) and the verdict, for the terminal."""
    names = results.get("profile_phases", [])
    head = f"{'deployment':<16s}{'goodput':>9s}{'failed':>8s}" + "".join(f"{n[:12]:>13s}" for n in names) + "  shapes"
    lines = [f"load profile {results.get('load_profile', '')}: goodput (req/s) overall and per phase", head]
    for name, e in results["deployments"].items():
        m = e["metrics"]
        lines.append(f"{name:<16s}{m['goodput']:>9.3f}{m['failed']:>8d}"
                     + "".join(f"{p['metrics']['goodput']:>13.3f}" for p in e["phases"])
                     + "  " + ",".join(e.get("shapes_seen", [])))
    for name, why in results.get("skipped", {}).items():
        lines.append(f"{name:<16s}skipped: {why.splitlines()[0] if why else ''}")
    v = results.get("verdict") or {}
    if v.get("passed") is None:
        lines.append(v.get("note", "not judged"))
    else:
        lines.append(f"verdict: {'PASS' if v['passed'] else 'FAIL'}")
        lines += [f"  [{'ok' if c['passed'] else 'FAIL'}] {c['name']}: {c['detail']}" for c in v["checks"]]
    return "\n".join(lines)
