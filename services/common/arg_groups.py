"""The titled sections of every command's --help.

A flag names its section where it is defined, so a flag that several commands share (`tandem up`,
the workers, the router, the gateway) shows under the same title in each of them, and the sections
come in the same order everywhere, whichever function added a flag first.
"""

from __future__ import annotations

import argparse

MODEL = "model"
ENGINE = "engine"
SCHEDULER = "scheduler"
SPECULATIVE = "speculative decoding"
LORA = "LoRA adapters"
DEPLOYMENT = "deployment"
DISAGGREGATION = "P/D disaggregation and KV transfer"
ROUTING = "routing"
PLANNER = "SLO planner"
LIMITS = "admission and request limits"
SECURITY = "security"
RESILIENCE = "resilience"
OBSERVABILITY = "observability"
GENERATION = "prompt and sampling"

# title -> one line under it; the order of the --help sections
SECTIONS: dict[str, str] = {
    GENERATION: "what to generate from, and how to pick the tokens (docs/sampling.md)",
    MODEL: "which model, in which dtype, on which device",
    ENGINE: "KV memory, attention, kernels, graphs and threads of each worker",
    SCHEDULER: "what a step batches, and which queued request is served first",
    SPECULATIVE: "draft tokens verified by the target model (docs/speculative.md)",
    LORA: "fine-tunes served beside the base model, mixed in one batch (docs/lora.md)",
    DEPLOYMENT: "which processes, where they listen, how they find each other",
    DISAGGREGATION: "prefill and decode workers and the KV transfer between them",
    ROUTING: "how the router picks the workers of a request (docs/routing.md)",
    PLANNER: "the shape (prefill and decode workers) that keeps the TTFT and ITL targets (docs/planner.md)",
    LIMITS: "what is refused at once: requests in flight, sizes of a request (docs/security.md)",
    SECURITY: "API key, internal secret, mutual TLS (docs/security.md)",
    RESILIENCE: "timeouts, retries, circuit breakers, restarts, drains, fault injection (docs/resilience.md)",
    OBSERVABILITY: "logs, metrics, profiles and traces (docs/observability.md)",
}


def arg_group(p: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """The section `title` (one of SECTIONS) of `p`, created on first use in its SECTIONS place."""
    if title not in SECTIONS:
        raise KeyError(f"unknown --help section {title!r}; add it to SECTIONS")
    for group in p._action_groups:
        if group.title == title:
            return group
    group = p.add_argument_group(title, SECTIONS[title])
    # argparse prints sections in creation order: move the new one before any that comes after it.
    order = list(SECTIONS)
    groups = p._action_groups
    groups.remove(group)
    later = [i for i, g in enumerate(groups) if g.title in SECTIONS and order.index(g.title) > order.index(title)]
    groups.insert(later[0] if later else len(groups), group)
    return group
