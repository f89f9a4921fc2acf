import math

import pytest

from tandem.engine.errors import InvalidRequest
from tandem.engine.sampling_params import SamplingParams, normalize_stop


def test_defaults_are_valid():
    SamplingParams().validate()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=1),
        dict(temperature=0.0),
        dict(temperature=2.0),
        dict(top_p=1e-6),
        dict(top_k=0),
        dict(top_k=-1),
        dict(top_k=50),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(repetition_penalty=0.5),
        dict(frequency_penalty=-2.0, presence_penalty=2.0),
        dict(top_logprobs=20, logprobs=True),
        dict(seed=-(2**63)),
        dict(seed=2**64 - 1),
        dict(stop=("a", "\n\n"), stop_token_ids=(0, 7)),
    ],
)
def test_edge_values_are_valid(kwargs):
    SamplingParams(**kwargs).validate()


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(temperature=2.01), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=math.nan), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=-0.01), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=math.nan), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(repetition_penalty=math.nan), "repetition_penalty"),
        (dict(frequency_penalty=2.01), "frequency_penalty"),
        (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(presence_penalty=-2.5), "presence_penalty"),
        (dict(presence_penalty=math.nan), "presence_penalty"),
        (dict(top_logprobs=-1), "top_logprobs"),
        (dict(top_logprobs=21), "top_logprobs"),
        (dict(seed=2**64), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(stop=("ok", "")), "stop"),
        (dict(stop=""), "stop"),
        (dict(stop_token_ids=(3, -1)), "stop_token_ids"),
    ],
)
def test_invalid_values_name_the_param(kwargs, param):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**kwargs).validate()
    assert err.value.param == param
    assert param in err.value.message


def test_invalid_request_is_a_value_error():
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0).validate()


def test_normalize_stop():
    assert normalize_stop(None) == ()
    assert normalize_stop("END") == ("END",)
    assert normalize_stop(["a", "b"]) == ("a", "b")
    assert normalize_stop(("a",)) == ("a",)


def test_sequences_are_stored_as_tuples_and_params_are_hashable():
    p = SamplingParams(stop="END", stop_token_ids=[1, 2])
    assert p.stop == ("END",)
    assert p.stop_token_ids == (1, 2)
    assert p == SamplingParams(stop=["END"], stop_token_ids=(1, 2))
    assert hash(p) == hash(SamplingParams(stop=["END"], stop_token_ids=(1, 2)))


def test_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
    assert not SamplingParams(temperature=0.7, top_k=-1).is_greedy
    assert not SamplingParams(temperature=0.7, top_k=2).is_greedy


def test_needs_penalties():
    assert not SamplingParams().needs_penalties
    assert SamplingParams(repetition_penalty=1.1).needs_penalties
    assert SamplingParams(frequency_penalty=0.5).needs_penalties
    assert SamplingParams(presence_penalty=-0.5).needs_penalties


def test_wants_logprobs():
    assert not SamplingParams().wants_logprobs
    assert SamplingParams(logprobs=True).wants_logprobs
    assert SamplingParams(top_logprobs=3).wants_logprobs
