"""The n-gram proposer, the adaptive gate and the KV shrink after rejected drafts (torch-free)."""

from __future__ import annotations

from tandem.engine.kvcache.kv_manager import KVManager
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.request import Request
from tandem.engine.spec.adaptive import SpecGate
from tandem.engine.spec.ngram import NgramProposer


def test_longest_suffix_match_proposes_its_continuation():
    p = NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 4, 5, 9, 2, 3], 3) == [4, 5, 9]
    # The longer n-gram wins over a more recent shorter one: [2, 3] after 1 -> 4, not 3 -> 7.
    assert p.propose([1, 2, 3, 4, 8, 3, 7, 1, 2, 3], 2) == [4, 8]


def test_no_match_or_too_short_proposes_nothing():
    p = NgramProposer(2, 4)
    assert p.propose([1, 2, 3, 4, 5], 4) == []
    assert p.propose([7], 4) == []
    assert p.propose([1, 2, 1, 2], 0) == []
    assert NgramProposer(1, 1).propose([5, 6, 5], 3) == [6, 5]


def test_loops_prefer_an_occurrence_with_a_whole_continuation():
    p = NgramProposer(2, 2)
    # The most recent [5, 5] is followed by one token only; an earlier one has all three.
    assert p.propose([5, 5, 5, 5, 5, 5, 5], 3) == [5, 5, 5]
    assert p.propose([7, 8, 7, 8, 7, 8], 3) == [7, 8, 7]


def test_gate_alternates_until_measured_then_follows_the_numbers():
    gate = SpecGate(probe_every=1000)
    decisions = [gate.decide(4, 16) for _ in range(4)]
    assert decisions == [True, False, True, False]
    assert gate.decide(4, 0) is False
    # Cheap drafts, all accepted: speculate.
    good = SpecGate(probe_every=1000)
    for i in range(12):
        drafts = 16 if i % 2 else 0
        good.observe(4, drafts, drafts, 0.010 + 0.0001 * drafts)
    assert good.decide(4, 16) is True
    # Expensive drafts, none accepted: do not.
    bad = SpecGate(probe_every=1000)
    for i in range(12):
        drafts = 16 if i % 2 else 0
        bad.observe(4, drafts, 0, 0.010 + 0.002 * drafts)
    assert bad.decide(4, 16) is False


def test_gate_probes_the_other_side_periodically():
    gate = SpecGate(probe_every=5)
    for i in range(12):
        drafts = 16 if i % 2 else 0
        gate.observe(4, drafts, 0, 0.010 + 0.002 * drafts)
    decisions = [gate.decide(4, 16) for _ in range(10)]
    assert decisions.count(True) == 2 and not decisions[0]


def test_gate_without_adaptation_always_verifies_drafts():
    gate = SpecGate(adaptive=False)
    assert all(gate.decide(2, 3) for _ in range(5))


def test_shrink_returns_pages_of_rejected_drafts_only():
    kv = KVManager(num_pages=8, page_size=4, max_slots=2)
    req = Request("r", list(range(6)), SamplingParams(max_tokens=10))
    assert kv.admit(req, req.all_ids)
    req.num_computed = 6
    assert kv.ensure_capacity(req, 6 + 5)            # room for 5 drafts: 3 pages
    assert len(req.pages) == 3 and kv.allocator.num_free == 5
    req.output_ids = [1, 2]                          # one draft accepted + the bonus token
    req.num_computed = 7
    kv.shrink(req, len(req.all_ids))
    assert len(req.pages) == 2 and kv.allocator.num_free == 6
    assert kv.slots.pages(req.slot) == req.pages
    kv.release(req)
    kv.check_idle()


def test_bad_speculative_config_is_refused_with_the_field_named():
    import pytest

    from tandem.engine.config import EngineConfig
    from tandem.engine.errors import InvalidRequest

    for kw, field in ((dict(speculative_algorithm="eagle"), "speculative_algorithm"),
                      (dict(speculative_algorithm="ngram", speculative_num_draft_tokens=0), "speculative_num_draft_tokens"),
                      (dict(speculative_algorithm="ngram", speculative_ngram_min=3, speculative_ngram_max=2),
                       "speculative_ngram_min"),
                      (dict(speculative_algorithm="draft"), "speculative_draft_model")):
        with pytest.raises(InvalidRequest, match=field):
            EngineConfig(**kw).validate()
    EngineConfig(speculative_algorithm="ngram").validate()
