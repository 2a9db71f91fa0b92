"""specjax.topk: the draft's top-k as one variadic reduction equals lax.top_k exactly (values, indices,
ties to the lower index, -inf rows, bf16); with the log-softmax in the same reduction, the indices of
lax.top_k(log_softmax) and its log-probs within float rounding (1e-4); an engine that runs them
(Kernels.draft_topk = "reduce") grows the same trees on this data: the same greedy output (that of
plain decoding) and the same acceptance as with lax.top_k."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import IdTokenizer, tiny_config, tiny_model
from jax import lax

from specjax import kernels as kernels_lib
from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.topk import top_k, top_k_log_softmax, top_k_reduce
from specjax.tree import SpecConfig


@pytest.mark.parametrize("shape,k", [((4, 16384), 4), ((2, 3, 100), 4), ((3, 50), 3), ((2, 33), 8),
                                     ((2, 33), 5), ((5, 20), 1), ((1, 7), 7), ((2, 2, 9), 6)])
def test_reduce_equals_lax_top_k(shape, k):
    rng = np.random.default_rng(k)
    x = np.round(rng.standard_normal(shape) * 3) / 3  # many ties
    x[..., ::7] = -np.inf
    x = x.astype(np.float32)
    rv, ri = lax.top_k(x, k)
    order = np.argsort(-x, axis=-1, kind="stable")[..., :k]  # brute force: the stable descending order
    # one stage; two stages (the default chunk; chunks of 8 with a padded tail where 8 does not divide V)
    for chunk in (0, None, 8):
        kw = {} if chunk is None else {"chunk": chunk}
        v, i = jax.jit(lambda a: top_k_reduce(a, k, **kw))(x)
        assert v.shape == rv.shape and i.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
        np.testing.assert_array_equal(np.asarray(v), np.asarray(rv))
        np.testing.assert_array_equal(np.asarray(i), order)


def test_reduce_edge_cases():
    x = jnp.full((2, 10), -jnp.inf)  # every entry -inf: the lowest indices
    v, i = top_k_reduce(x, 3)
    assert np.asarray(i).tolist() == [[0, 1, 2]] * 2 and np.all(np.isneginf(np.asarray(v)))
    xb = jnp.asarray(np.random.default_rng(0).standard_normal((4, 1000)), jnp.bfloat16)
    v, i = top_k(xb, 4, "reduce")
    rv, ri = top_k(xb, 4, "xla")
    assert v.dtype == jnp.bfloat16 and (np.asarray(i) == np.asarray(ri)).all() and (np.asarray(v) == np.asarray(rv)).all()
    with pytest.raises(ValueError, match="k=11 must be in 1..10"):
        top_k_reduce(jnp.zeros((2, 10)), 11)
    with pytest.raises(ValueError, match="must be one of"):
        top_k(jnp.zeros((2, 10)), 2, "sort")


def test_draft_topk_choice():
    choose = kernels_lib.choose_draft_topk  # "auto": the reduction where it was measured faster
    assert choose("auto", "gpu") == "reduce" and choose("auto", "cpu") == "xla" and choose("auto", "tpu") == "xla"
    assert choose("reduce", "cpu") == "reduce" and choose("xla", "gpu") == "xla"  # a forced one holds everywhere
    assert choose("auto") == ("reduce" if jax.default_backend() == "gpu" else "xla")
    with pytest.raises(ValueError, match=r"draft_topk must be one of \('auto', 'xla', 'reduce'\), got 'sort'"):
        choose("sort")


@pytest.mark.parametrize("shape,k,scale", [((4, 16384), 4, 4.0), ((2, 3, 100), 3, 1.0), ((2, 50), 8, 10.0),
                                           ((1, 7), 7, 1.0)])
def test_log_softmax_in_the_reduction(shape, k, scale):
    rng = np.random.default_rng(k)
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    x[..., ::5] = -np.inf
    ref, rids = lax.top_k(jax.nn.log_softmax(jnp.asarray(x), axis=-1), k)
    for chunk in (0, 512, 8):  # one stage, two stages (a padded tail where the chunk does not divide V)
        lp, ids = jax.jit(top_k_log_softmax, static_argnums=(1, 2, 3))(x, k, "reduce", chunk)
        assert lp.dtype == jnp.float32 and ids.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(rids))
        # -inf where ref is; else the rounding of two sums of V exponentials in other orders
        np.testing.assert_allclose(np.asarray(lp), np.asarray(ref), rtol=0, atol=1e-4)
    xla_lp, xla_ids = top_k_log_softmax(x, k, "xla")
    assert (np.asarray(xla_ids) == np.asarray(rids)).all()
    np.testing.assert_array_equal(np.asarray(xla_lp), np.asarray(ref))
    # bf16 logits: computed in float32
    lpb, idb = top_k_log_softmax(jnp.asarray(x, jnp.bfloat16), k, "reduce")
    refb = lax.top_k(jax.nn.log_softmax(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), axis=-1), k)
    assert (np.asarray(idb) == np.asarray(refb[1])).all()
    np.testing.assert_allclose(np.asarray(lpb), np.asarray(refb[0]), rtol=0, atol=1e-4)
    # a row of -inf: -inf log-probs, the lowest ids
    lp0, id0 = top_k_log_softmax(jnp.full((1, 9), -jnp.inf), 2, "reduce")
    assert np.all(np.isneginf(np.asarray(lp0))) and np.asarray(id0).tolist() == [[0, 1]]


def test_engine_with_the_reduce_top_k_grows_the_same_trees():
    from test_spec_eagle import random_head
    cfg = tiny_config(num_hidden_layers=4)
    target = tiny_model(cfg, seed=0)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 96, size=n)] for n in (1, 9, 23, 4)]
    head, ecfg = random_head(cfg, "eagle3", draft_vocab=60)
    spec = SpecConfig(method="eagle3", num_steps=3, topk=3, num_draft_tokens=7)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def run(draft_topk, with_draft=True):
        draft = Draft(head, ecfg.layer, DraftInfo("eagle3", ecfg.aux_layers), spec) if with_draft else None
        eng = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=64), BatchOptions(max_batch=2),
                     jnp.float32, draft=draft, draft_topk=draft_topk)
        reqs = [Request(i, None, p, params, IdTokenizer(), (96,), 64, 100 + i) for i, p in enumerate(prompts)]
        eng.run(reqs)
        return eng, [r.output() for r in reqs]

    eng, red = run("reduce")
    assert eng.kernels.draft_topk == "reduce" and "draft top-k: reduce" in eng.info
    _, xla = run("xla")
    _, plain = run("xla", with_draft=False)
    assert [o.token_ids for o in red] == [o.token_ids for o in xla] == [o.token_ids for o in plain]
    assert [o.accept_len_mean for o in red] == [o.accept_len_mean for o in xla]  # the same trees
    assert any(o.accept_len_mean > 1 for o in red)
