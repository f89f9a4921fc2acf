"""Future tokens for overlap scheduling (torch-free).

With overlap, step N+1 is scheduled and its inputs built while step N's forward pass runs, so a
running request's newest token is not known yet. Its input row then carries a *future reference*:
a negative id naming a slot of the runner's future-token map, which step N's sampler writes and
step N+1's forward pass reads (resolved on the device just before the embedding lookup). Forward
passes run one at a time in launch order, so a slot written by step N is read by step N+1 before
anything can write it again, as long as the map holds two steps' worth of sampled tokens.
"""

from __future__ import annotations


def future_ref(index: int) -> int:
    """The input id that stands for the token sampled into future-map slot `index`."""
    return -(index + 1)


class FutureSlots:
    """Hands out future-map slots round-robin; `size` must cover two steps' sampled tokens."""

    def __init__(self, max_sampled_per_step: int):
        self.size = 2 * max_sampled_per_step + 2
        self._next = 0

    def take(self) -> int:
        i = self._next
        self._next = (i + 1) % self.size
        return i
