"""SamplingParams validation: every bad value is refused with a message naming the field."""
from __future__ import annotations

import math

import pytest

from specjax.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError

BAD = [
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", True), ("max_tokens", "8"),
    ("max_tokens", None),
    ("temperature", -1), ("temperature", -1e-9), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", True), ("temperature", "0.5"), ("temperature", None),
    ("top_p", 0), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1), ("top_p", math.nan), ("top_p", "1"),
    ("top_k", -2), ("top_k", 1.5), ("top_k", True), ("top_k", "3"),
    ("seed", "x"), ("seed", 1.0), ("seed", True),
    ("stop", [""]), ("stop", [3]), ("stop", ""), ("stop", ["ok", None]),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]), ("stop_token_ids", ["2"]),
    ("logprobs", MAX_LOGPROBS + 1), ("logprobs", -1), ("logprobs", 1.5), ("logprobs", True),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_values_raise_naming_the_field(field, value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{field: value})
    assert field in str(e.value)
    assert isinstance(e.value, ValueError)  # callers catching ValueError see it too


def test_first_bad_field_is_named_among_good_ones():
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(max_tokens=4, temperature=0.5, top_p=2.0, top_k=5)


GOOD = [
    dict(), dict(max_tokens=1), dict(temperature=0), dict(temperature=0.0), dict(temperature=2), dict(top_p=1),
    dict(top_p=1e-6), dict(top_k=0), dict(top_k=-1), dict(top_k=1), dict(seed=0), dict(seed=2**40),
    dict(seed=-3), dict(stop="x"), dict(stop=["a", "bc"]), dict(stop=None), dict(stop_token_ids=[0, 5]),
    dict(logprobs=0), dict(logprobs=MAX_LOGPROBS), dict(logprobs=None), dict(ignore_eos=True),
]


@pytest.mark.parametrize("kw", GOOD, ids=[repr(k) for k in GOOD])
def test_good_values_pass(kw):
    sp = SamplingParams(**kw)
    for k, v in kw.items():
        if k not in ("top_k", "stop", "stop_token_ids"):
            assert getattr(sp, k) == v


def test_normalization():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=7).top_k == 7
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.1).greedy
    d = SamplingParams()
    assert (d.max_tokens, d.temperature, d.top_p, d.top_k, d.seed, d.ignore_eos, d.logprobs) == \
        (16, 1.0, 1.0, 0, None, False, None)


def test_top_p_bool_rejected():
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=True)
