"""Speculative sampling with the n-gram drafter is lossless: its drafts are point masses (a
deterministic function of the text so far), verified by recursive rejection sampling; on a
tiny-vocabulary random model the joint law of the first three generated tokens equals the exact
law of plain sampling (chi-square, as in test_spec_sampling), for chains and tries, and drafts
are accepted. The prompt repeats itself, so the drafts come from real matches."""
from __future__ import annotations

import pytest
from test_spec_sampling import _chi2_pvalue, _counts, _exact_law, _spec_samples, models  # noqa: F401

from specjax.tree import SpecConfig

PROMPT = [1, 4, 2, 1, 4]  # "1 4" recurs: the suffix matches at position 2 (n = 2), proposing "2 1 4 ..."


@pytest.mark.parametrize("spec,temperature,top_p", [
    (SpecConfig(method="ngram", num_steps=2, topk=1), 0.9, 0.9),
    (SpecConfig(method="ngram", num_steps=3, topk=2, num_draft_tokens=4, ngram_max=3, ngram_min=1), 1.0, 0.85),
])
def test_ngram_sampling_matches_plain_law(models, spec, temperature, top_p):  # noqa: F811
    cfg, target, _ = models
    probs = _exact_law(cfg, target, temperature, top_p, prompt=PROMPT)
    first3, n_acc = _spec_samples(cfg, target, None, spec, temperature, top_p, prompt=PROMPT)
    pval, stat, dof = _chi2_pvalue(_counts(first3), probs)
    assert pval > 1e-3, (pval, stat, dof)
    assert (n_acc >= 1).all() and (n_acc <= spec.num_steps + 1).all()
    assert n_acc.mean() > 1.05  # the point-mass drafts do get accepted
    wrong = _exact_law(cfg, target, temperature + 0.4, top_p, prompt=PROMPT)
    assert _chi2_pvalue(_counts(first3), wrong)[0] < 1e-6  # the check has power: another law is rejected



def test_model_draft_tree_with_an_ngram_branch_samples_the_plain_law(models):  # noqa: F811
    """SpecConfig.ngram_branch under sampling: a draft model's tree (point-mass proposals) plus an
    n-gram branch under the root, merged where they coincide; the first three tokens follow plain
    sampling's exact law (chi-square) and a wrong law is rejected."""
    cfg, target, draft = models
    spec = SpecConfig(method="draft", num_steps=3, topk=2, num_draft_tokens=4, ngram_branch=3)
    probs = _exact_law(cfg, target, 0.9, 0.9, prompt=PROMPT)
    first3, n_acc = _spec_samples(cfg, target, draft, spec, 0.9, 0.9, prompt=PROMPT)
    pval, stat, dof = _chi2_pvalue(_counts(first3), probs)
    assert pval > 1e-3, (pval, stat, dof)
    assert (n_acc >= 1).all() and (n_acc <= spec.num_steps + 1).all() and n_acc.mean() > 1.05
    assert _chi2_pvalue(_counts(first3), _exact_law(cfg, target, 1.3, 0.9, prompt=PROMPT))[0] < 1e-6
