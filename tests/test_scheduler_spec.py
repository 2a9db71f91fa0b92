"""The scheduler and the one-step-behind loop with speculative decoding (draft model; chain and
tree): requests arriving over time get what they get alone, greedy rows what plain decoding gives;
preemption under a tiny page budget changes no output. Plain decoding: tests/test_scheduler.py."""
from __future__ import annotations

import pytest

from test_scheduler import check_arrivals, check_preemption, engine, make_models, preemption_items, run_alone, workload

MODES = ("chain", "tree")


@pytest.fixture(scope="module")
def models():
    return make_models()


@pytest.fixture(scope="module")
def plain_greedy(models):
    """Greedy rows of the workload, each alone through plain decoding."""
    items = workload()
    greedy = [i for i, (_, sp, _) in enumerate(items) if sp.temperature == 0]
    return dict(zip(greedy, run_alone(engine(models, "plain", max_batch=1), [items[i] for i in greedy])))


@pytest.fixture(scope="module", params=MODES)
def spec_eng(request, models):
    return request.param, engine(models, request.param)


def test_arrivals_over_time_equal_alone(spec_eng, plain_greedy):
    mode, eng = spec_eng
    items = workload()
    alone = run_alone(eng, items)
    reqs = check_arrivals(eng, items, alone)
    for i, want in plain_greedy.items():  # lossless: greedy speculation == plain greedy
        assert alone[i] == want, (mode, i)
    assert all(r.accept_lens for r in reqs if len(r.token_ids) > 1)
    assert max(max(r.accept_lens, default=0) for r in reqs) > 1  # drafts do get accepted


def test_preemption_under_a_tiny_page_budget(spec_eng):
    check_preemption(spec_eng[1], preemption_items(sampled=False))
