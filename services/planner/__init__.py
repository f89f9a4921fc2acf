"""The SLO planner: decides how many prefill and decode workers serve the load (docs/planner.md)."""
