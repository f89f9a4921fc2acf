"""The structured-output P/D benchmark's pure parts: the request order, the schema it sends, and the
report's math (no servers, no model, no torch)."""

import pytest

from tandem.bench import structured_pd as spd
from tandem.bench.structured_pd import FREE, SCHEMA, Sample


def s(kind: str, prompt: int, ttft: float | None, e2e: float = 1.0, tokens: int = 11, **kw) -> Sample:
    return Sample(kind, prompt, ttft, e2e, tokens, **kw)


def test_every_prompt_is_sent_once_per_kind_and_the_first_kind_alternates():
    seq = spd.order(4)
    assert sorted(seq) == sorted((i, k) for i in range(4) for k in (FREE, SCHEMA))
    assert [k for _, k in seq[::2]] == [FREE, SCHEMA, FREE, SCHEMA]
    assert len(set(spd.prompts(30))) == 30


def test_the_schema_is_the_pydantic_models_strict_and_closed():
    fmt = spd.response_format(spd.Person)["json_schema"]
    assert fmt["strict"] is True and fmt["name"] == "Person"
    assert fmt["schema"]["additionalProperties"] is False
    assert set(fmt["schema"]["required"]) == set(spd.Person.model_fields)


def test_tpot_excludes_the_first_token_and_needs_two():
    assert s(FREE, 0, 0.2, e2e=1.2, tokens=11).tpot_s == pytest.approx(0.1)
    assert s(FREE, 0, 0.2, tokens=1).tpot_s is None
    assert s(FREE, 0, None).tpot_s is None and not s(FREE, 0, None).ok


def test_summary_differences_are_schema_minus_free_and_paired_by_prompt():
    samples = [s(FREE, 0, 0.100), s(SCHEMA, 0, 0.130, valid=True, finish_reason="stop"),
               s(FREE, 1, 0.200), s(SCHEMA, 1, 0.210, valid=False, finish_reason="length"),
               s(FREE, 2, 0.300), s(SCHEMA, 2, None, error="APIError: boom")]
    out = spd.mode_summary(samples, first_schema=s(SCHEMA, -1, 0.5))
    assert out[FREE]["ttft_ms_p50"] == pytest.approx(200.0)
    assert out[SCHEMA]["ttft_ms_p50"] == pytest.approx(170.0) and out[SCHEMA]["failed"] == 1
    assert out["ttft_p50_diff_ms"] == pytest.approx(-30.0)            # an unpaired free request pulls it
    assert spd.paired_ttft_diffs(samples) == pytest.approx([0.030, 0.010])
    assert out["ttft_paired_diff_ms_p50"] == pytest.approx(20.0)
    assert out[SCHEMA]["valid"] == 1 and out[SCHEMA]["cut_or_invalid"] == 1
    assert out[SCHEMA]["finish_reasons"] == {"stop": 1, "length": 1}
    assert out["first_schema"]["over_cached_ttft_p50_ms"] == pytest.approx(330.0)
    assert out["new_schema"] is None


def test_tpot_overhead_and_the_handoff_share():
    def mode(free_ttft: float, schema_ttft: float, schema_e2e: float) -> dict:
        return spd.mode_summary([s(FREE, 0, free_ttft, e2e=free_ttft + 1.0),
                                 s(SCHEMA, 0, schema_ttft, e2e=schema_ttft + schema_e2e)])
    disagg, colo = mode(0.1, 0.15, 1.1), mode(0.1, 0.11, 1.0)
    assert disagg["tpot_p50_overhead_pct"] == pytest.approx(10.0)
    assert spd.handoff_share({"disagg": disagg, "colocated": colo}) == pytest.approx(40.0)
    assert spd.handoff_share({"disagg": disagg}) is None
    text = spd.table({"disagg": disagg, "colocated": colo})
    assert "schema - free" in text and "+40.0 ms" in text


def test_an_empty_kind_reports_nothing_rather_than_failing():
    out = spd.mode_summary([s(FREE, 0, 0.1)])
    assert out[SCHEMA]["ttft_ms_p50"] is None and out["ttft_p50_diff_ms"] is None
    assert out["tpot_p50_overhead_pct"] is None
    spd.table({"disagg": out})


def test_modes_parse_and_reject_unknown_names():
    assert spd.parse_modes("disagg, colocated") == ("disagg", "colocated")
    with pytest.raises(ValueError, match="1p1d"):
        spd.parse_modes("1p1d")
