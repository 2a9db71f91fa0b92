"""The scheduler and the one-step-behind loop with speculative decoding (draft model; chain and
tree): requests arriving over time get what they get alone, greedy rows what plain decoding gives;
preemption under a tiny page budget changes no output. Plain decoding: tests/test_scheduler.py.

The chain's workload has stop lists of 8 ids (with EOS: stop-id widths 4, 8 and 16, each its own
program); the tree's has the first 3 of them (width 4 only: 9 programs compiled instead of ~14)."""
from __future__ import annotations

import pytest

from test_scheduler import check_arrivals, check_preemption, engine, make_models, preemption_items, run_alone, workload

MODES = ("chain", "tree")
STOP_IDS = {"chain": 8, "tree": 3}  # stop_token_ids per list in each mode's workload


@pytest.fixture(scope="module")
def models():
    return make_models()


@pytest.fixture(scope="module")
def plain_greedy(models):
    """Greedy rows of each mode's workload, each alone through plain decoding."""
    eng = engine(models, "plain", max_batch=1)
    out = {}
    for mode in MODES:
        items = workload(stop_ids=STOP_IDS[mode])
        greedy = [i for i, (_, sp, _) in enumerate(items) if sp.temperature == 0]
        out[mode] = dict(zip(greedy, run_alone(eng, [items[i] for i in greedy])))
    return out


@pytest.fixture(scope="module", params=MODES)
def spec_eng(request, models):
    return request.param, engine(models, request.param)


def test_arrivals_over_time_equal_alone(spec_eng, plain_greedy):
    mode, eng = spec_eng
    items = workload(stop_ids=STOP_IDS[mode])
    alone = run_alone(eng, items)
    reqs = check_arrivals(eng, items, alone)
    for i, want in plain_greedy[mode].items():  # lossless: greedy speculation == plain greedy
        assert alone[i] == want, (mode, i)
    assert all(r.accept_lens for r in reqs if len(r.token_ids) > 1)
    assert max(max(r.accept_lens, default=0) for r in reqs) > 1  # drafts do get accepted


def test_preemption_under_a_tiny_page_budget(spec_eng):
    check_preemption(spec_eng[1], preemption_items(sampled=False))
