"""`cache_aware`: the worker that would serve this request soonest counting its prefix cache, unless
the workers' loads are too far apart.

Balanced (the busiest has at most `--balance-abs-threshold` more requests than the idlest, or at
most `--balance-rel-threshold` times as many): the least `Candidate.prefill_cost`, i.e. queued
prefill tokens plus the part of this prompt the worker lacks — for a prefill worker the compute its
cache saves, for a decode worker the pages it need not receive. Imbalanced: `least_load`, as in
SGLang's router, so that a popular prefix does not pile every request onto one worker.
"""

from __future__ import annotations

from tandem.services.router.policy import Policy, least_load_key, register_policy


@register_policy("cache_aware")
class CacheAware(Policy):
    def pick(self, request, candidates):
        assert candidates
        loads = [c.requests for c in candidates]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.cfg.balance_abs_threshold and hi > lo * self.cfg.balance_rel_threshold:
            return min(candidates, key=least_load_key)
        return min(candidates, key=lambda c: (c.prefill_cost, c.requests, -c.free_ratio))
