"""Pairing policies: which worker of a role gets the next request. Plug new ones in with `register_policy`.

Every policy sees the request (`RouteRequest`: its adapter and prompt key) and the same `Candidate`s
(services/router/cost.py): reported load, this router's in-flight work, and how much of the prompt
the router believes each worker has cached. The planner has already narrowed the candidates of an
adapter's request to the workers that should take it (lora_routing.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem.services.router.cache_view import PromptKey
from tandem.services.router.cost import Candidate
from tandem.services.router.route_config import RouteConfig


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may know about the request it routes."""

    key: PromptKey                # the prompt as the router hashes it (under the adapter's key for an adapter)
    adapter: str = ""             # the LoRA adapter it names ("": the base model)


class Policy(ABC):
    """Picks one of `candidates` (non-empty, in the registry's stable order). One instance serves one role."""

    def __init__(self, cfg: RouteConfig) -> None:
        self.cfg = cfg

    @abstractmethod
    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate:
        ...


_POLICIES: dict[str, Callable[[RouteConfig], Policy]] = {}


def register_policy(name: str) -> Callable[[type[Policy]], type[Policy]]:
    def deco(cls: type[Policy]) -> type[Policy]:
        assert name not in _POLICIES, f"policy {name!r} registered twice"
        _POLICIES[name] = cls
        return cls

    return deco


def policy_names() -> list[str]:
    _load_builtin()
    return sorted(_POLICIES)


def make_policy(name: str, cfg: RouteConfig | None = None) -> Policy:
    _load_builtin()
    try:
        factory = _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(policy_names())}") from None
    return factory(cfg or RouteConfig())


def _load_builtin() -> None:
    # One module per policy beyond the two simplest; importing registers it.
    import tandem.services.router.policy_cache_aware  # noqa: F401


def least_load_key(c: Candidate) -> tuple[int, int, float]:
    """Least queued prefill work (tokens), then fewest requests, then most free KV pages."""
    return (c.queued_tokens, c.requests, -c.free_ratio)


@register_policy("round_robin")
class RoundRobin(Policy):
    def __init__(self, cfg: RouteConfig) -> None:
        super().__init__(cfg)
        self._next = 0

    def pick(self, request, candidates):
        assert candidates
        worker = candidates[self._next % len(candidates)]
        self._next += 1
        return worker


@register_policy("least_load")
class LeastLoad(Policy):
    """The least queued prefill work in tokens (reported, or this router's own since, whichever is
    larger), then the fewest queued + running requests, then the most free KV pages, then list order."""

    def pick(self, request, candidates):
        assert candidates
        return min(candidates, key=least_load_key)
