"""logit_bias and min_p in the per-row sampler, and their request fields."""
from __future__ import annotations

import random

import pytest
import torch

from ktinject.serve.errors import RequestError
from ktinject.serve.sampling import SamplingParams, sample


def _rngs(n, seed=0):
    return [random.Random(seed + i) for i in range(n)]


def test_logit_bias_moves_greedy_and_sampled_rows_only_where_given():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]] * 3)
    plain = SamplingParams(max_tokens=1, temperature=0)
    biased = SamplingParams(max_tokens=1, temperature=0, logit_bias=((2, 100.0),))
    hot = SamplingParams(max_tokens=1, temperature=1.0, logit_bias=((0, -100.0), (3, 100.0)))
    assert sample(logits, [plain, biased, hot], _rngs(3)) == [0, 2, 3]
    assert logits[0, 0] == 5.0  # the caller's logits are left as they were


def test_min_p_keeps_only_tokens_near_the_top():
    logits = torch.tensor([[2.0, 1.9, -5.0, -5.0]] * 64)
    wide = SamplingParams(max_tokens=1, temperature=1.0)
    strict = SamplingParams(max_tokens=1, temperature=1.0, min_p=0.5)  # keeps tokens 0 and 1 only
    one = SamplingParams(max_tokens=1, temperature=1.0, min_p=1.0)  # only the most likely token
    assert set(sample(logits, [strict] * 64, _rngs(64))) <= {0, 1}
    assert set(sample(logits, [one] * 64, _rngs(64))) == {0}
    flat = torch.zeros(64, 4)
    assert len(set(sample(flat, [wide] * 64, _rngs(64)))) > 2


@pytest.mark.parametrize("kw,param", [({"min_p": 1.5}, "min_p"), ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
                                      ({"logit_bias": ((-1, 1.0),)}, "logit_bias")])
def test_bad_values_name_the_field(kw, param):
    with pytest.raises(RequestError) as e:
        SamplingParams(max_tokens=1, **kw)
    assert e.value.param == param


def test_request_fields_become_sampling_params():
    pytest.importorskip("pydantic")
    from ktinject.serve.protocol import ChatRequest

    body = ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"7": -100},
                                       "min_p": 0.1})
    p = body.sampling({"temperature": 1.0, "top_p": 1.0, "top_k": 0}, 8)
    assert p.logit_bias == ((7, -100.0),) and p.min_p == 0.1
    for bad in ({"x": 1}, {"7": "high"}, {"7": True}):
        body = ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "logit_bias": bad})
        with pytest.raises(RequestError) as e:
            body.sampling({"temperature": 1.0, "top_p": 1.0, "top_k": 0}, 8)
        assert e.value.param == "logit_bias"
