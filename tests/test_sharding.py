"""Tensor parallelism (specjax.sharding) on 8 host devices (tests/conftest.py): sharded greedy
decoding must equal single-device decoding token for token, through the jitted steps and
through the Engine, with one compilation per step signature."""
from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import IdTokenizer, tiny_model
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from specjax import checkpoint, decode, sharding
from specjax.config import ModelConfig
from specjax.engine import BatchOptions, CacheOptions, Engine
from specjax.kv_cache import init_cache
from specjax.models.llama import flat_state
from specjax.request import Request
from specjax.sampling import SamplingArrays
from specjax.sampling_params import SamplingParams

MAX_SEQ = 64
PAGE = 8
SLOTS = 4
PAD_T = 24
STEPS, CALLS = 5, 3  # decode_many(num_steps=STEPS) called CALLS times
PROMPT_LENS = (7, 1, 13, 20)
KINDS = {  # name -> config overrides
    "gqa": dict(num_key_value_heads=4),
    "mha-tied": dict(num_key_value_heads=8, tie_word_embeddings=True),  # lm_head = embed.T, vocab-sharded
}


def hf_dict(kind: str) -> dict:
    d = dict(architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=32, intermediate_size=64,
             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
             rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=127)
    d.update(KINDS[kind])
    return d


def config(kind: str) -> ModelConfig:
    return ModelConfig.from_hf_dict(hf_dict(kind))


PROMPTS = [[int(t) for t in np.random.default_rng(0).integers(0, 127, size=n)] for n in PROMPT_LENS]


@contextlib.contextmanager
def count_compiles():
    """Yields a list that collects one entry per XLA backend compilation inside the block."""
    seen: list[str] = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(event)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def mesh_of(tp: int):
    """make_mesh(tp), or skip the test where fewer devices exist (tests/conftest.py asks for 8 CPUs)."""
    if len(jax.devices()) < tp:
        pytest.skip(f"needs {tp} devices, {len(jax.devices())} available")
    return sharding.make_mesh(tp)


def assert_one_executable(*jitted):
    """Each jitted function holds exactly one compiled signature (checked where jax exposes it)."""
    for fn in jitted:
        if hasattr(fn, "_cache_size"):
            assert fn._cache_size() == 1


# ----------------------------------------------------------------- the plain steps, sharded or not

def _state(cfg, mesh=None):
    pps = MAX_SEQ // PAGE

    def make():
        cache = init_cache(cfg, num_pages=1 + SLOTS * pps, page_size=PAGE, max_slots=SLOTS,
                           max_seq_len=MAX_SEQ, dtype=jnp.float32)
        table = 1 + np.arange(SLOTS)[:, None] * pps + np.arange(pps)[::-1][None, :]  # non-contiguous
        cache = dataclasses.replace(cache, page_table=jnp.asarray(table, jnp.int32))
        return decode.DecodeState(cache, jnp.zeros((SLOTS,), jnp.int32))
    return make() if mesh is None else sharding.shard_cache(make(), mesh)


def greedy_run(model, cfg, mesh=None):
    """Prefill PROMPTS, then CALLS x decode_many. -> (tokens [SLOTS, 1 + CALLS * STEPS],
    logprobs of the same shape, steps, final state, backend compiles after the first calls)."""
    steps, weights = decode.compile_steps(*nnx.split(model))
    state = _state(cfg, mesh)
    toks = np.zeros((SLOTS, PAD_T), np.int32)
    for r, p in enumerate(PROMPTS):
        toks[r, : len(p)] = p
    lens = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
    slots, active = jnp.arange(SLOTS, dtype=jnp.int32), jnp.ones((SLOTS,), bool)
    out, state = steps.prefill(weights, state, jnp.asarray(toks), lens, slots, None, want_logprobs=True,
                               stochastic=False)
    tokens, logprobs = [np.asarray(out.tokens)[None]], [np.asarray(out.logprob)[None]]
    with count_compiles() as later:
        for call in range(CALLS):
            outs, state = steps.decode_many(weights, state, slots, active, None, num_steps=STEPS,
                                            want_logprobs=True, stochastic=False)
            tokens.append(np.asarray(outs.tokens))
            logprobs.append(np.asarray(outs.logprob))
            if call == 0:
                later.clear()  # the first decode_many compiles; later calls must not
    return np.concatenate(tokens).T, np.concatenate(logprobs).T, steps, state, len(later)


_REFS: dict[str, tuple] = {}


def reference(kind: str):
    """Single-device greedy run of the `kind` model (computed once per kind)."""
    if kind not in _REFS:
        cfg = config(kind)
        toks, lps, *_ = greedy_run(tiny_model(cfg, seed=0), cfg)
        assert len(set(toks.ravel().tolist())) > 5, "degenerate reference"
        _REFS[kind] = (toks, lps)
    return _REFS[kind]


@pytest.mark.parametrize("kind,tp", [("gqa", 2), ("gqa", 4), ("mha-tied", 8)])
def test_tensor_parallel_greedy_equals_single_device(kind, tp):
    ref_toks, ref_lps = reference(kind)
    cfg = config(kind)
    mesh = mesh_of(tp)
    model = sharding.shard_model(tiny_model(cfg, seed=0), mesh)
    toks, lps, steps, state, later_compiles = greedy_run(model, cfg, mesh)
    np.testing.assert_array_equal(toks, ref_toks)
    np.testing.assert_allclose(lps, ref_lps, rtol=1e-4, atol=1e-4)

    # one executable per step, none compiled after the first decode_many
    assert later_compiles == 0
    assert_one_executable(steps.prefill, steps.decode_many)

    # really sharded: weights split on heads / mlp / vocab, cache on kv_heads, rest replicated
    E, H, K, D, F, V = 32, 8, cfg.num_kv_heads, 8, 64, 128
    attn, mlp = model.layers[0].attn, model.layers[0].mlp
    for arr, spec, shard in [(attn.wq[...], P(None, "tp", None), (E, H // tp, D)),
                             (attn.wk[...], P(None, "tp", None), (E, K // tp, D)),
                             (attn.wo[...], P("tp", None, None), (H // tp, D, E)),
                             (mlp.w_up[...], P(None, "tp"), (E, F // tp)),
                             (mlp.w_down[...], P("tp", None), (F // tp, E)),
                             (model.embed[...], P("tp", None), (V // tp, E)),
                             (model.norm.scale[...], P(None), (E,))]:
        assert arr.sharding.spec == spec
        assert {s.data.shape for s in arr.addressable_shards} == {shard}
        assert len(arr.sharding.device_set) == tp
    # the donated state comes back in the layout it went in with
    kv = state.cache.kv[0]
    assert kv.sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, None, "tp", None)), kv.ndim)
    assert kv.addressable_shards[0].data.shape == (kv.shape[0], PAGE, 2, K // tp, D)
    for arr in (state.cache.page_table, state.cache.seq_lens, state.last_tokens):
        assert arr.sharding.is_fully_replicated and len(arr.sharding.device_set) == tp


# ----------------------------------------------------------------- the engine

def _engine_run(model, cfg, mesh=None):
    eng = Engine(model, cfg, CacheOptions(page_size=PAGE, max_seq_len=MAX_SEQ), BatchOptions(max_batch=SLOTS,
                 steps_per_call=4), jnp.float32, mesh=mesh)  # with a mesh: the cache is created sharded
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=0)
    reqs = [Request(i, None, p[:16], params, IdTokenizer(), (), MAX_SEQ, 0) for i, p in enumerate(PROMPTS)]
    eng.run(reqs)
    assert all(r.finished for r in reqs)
    return eng, [r.token_ids for r in reqs], [[lp for d in r.logprobs for lp in d.values()] for r in reqs]


def test_engine_with_sharded_model_and_cache():
    cfg = config("gqa")
    ref_eng, ref_ids, ref_lps = _engine_run(tiny_model(cfg, seed=0), cfg)
    mesh = mesh_of(4)
    eng, ids, lps = _engine_run(sharding.shard_model(tiny_model(cfg, seed=0), mesh), cfg, mesh)
    assert ids == ref_ids
    for a, b in zip(lps, ref_lps, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert eng.weights[0].sharding.mesh.shape["tp"] == 4
    kv = eng.state.cache.kv[0]
    assert kv.sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, None, "tp", None)), kv.ndim)
    # one executable per step, like the single-device engine (page-table pushes do not recompile)
    assert_one_executable(eng.steps.prefill, eng.steps.decode_many, ref_eng.steps.prefill,
                          ref_eng.steps.decode_many)


# ----------------------------------------------------------------- rules and errors

def test_make_mesh():
    mesh = mesh_of(2)
    assert dict(mesh.shape) == {"tp": 2}
    assert tuple(mesh.axis_types) == (jax.sharding.AxisType.Auto,)
    n = len(jax.devices())
    with pytest.raises(ValueError, match=f"needs {n + 1} devices, only {n}"):
        sharding.make_mesh(n + 1)
    with pytest.raises(ValueError, match=">= 1"):
        sharding.make_mesh(0)
    with pytest.raises(ValueError, match="needs 3 devices, only 2"):
        sharding.make_mesh(3, devices=jax.devices()[:2])
    assert sharding.make_mesh(1).devices.size == 1


def test_kv_heads_not_divisible_is_a_clear_error():
    cfg = config("gqa")  # 4 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel=8 does not divide kv_heads=4.*whole KV heads"):
        sharding.check_divisible(cfg, 8)
    mesh = mesh_of(8)
    model = tiny_model(cfg, seed=0)
    wk = r"parameter layers.0.attn.wk: dim 1 \(kv_heads=4\) is not divisible by mesh axis 'tp' of size 8"
    with pytest.raises(ValueError, match=wk):
        sharding.shard_model(model, mesh)
    with pytest.raises(ValueError, match=r"KV pages cache.kv.0: dim 3 \(kv_heads=4\)"):
        sharding.shard_cache(_state(cfg), mesh)


def test_vocab_rules():
    odd = ModelConfig.from_hf_dict({**hf_dict("gqa"), "vocab_size": 97})
    with pytest.raises(ValueError, match="vocab=97"):
        sharding.check_divisible(odd, 2)
    rules = sharding.resolve_rules(odd, 2)
    assert rules["vocab"] is None and rules["heads"] == "tp"
    assert sharding.resolve_rules(config("gqa"), 2)["vocab"] == "tp"


def test_create_sharded_matches_shard_cache():
    cfg, mesh = config("gqa"), mesh_of(4)
    direct = sharding.create_sharded(lambda: _state(cfg), mesh)
    placed = _state(cfg, mesh)
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(placed), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------- checkpoints

def test_restore_sharded_round_trip(tmp_path):
    kind = "gqa"
    model = tiny_model(config(kind), seed=3)
    flat = {k: np.asarray(v) for k, v in flat_state(model).items()}
    checkpoint.save_model_dir(tmp_path / "m", flat, hf_dict(kind), "float32")
    mesh = mesh_of(4)
    cfg, restored = sharding.restore_sharded(tmp_path / "m", mesh)
    expected = sharding.flat_param_shardings(cfg, mesh)
    got = flat_state(restored)
    assert set(got) == set(flat)
    for name, arr in got.items():
        np.testing.assert_array_equal(np.asarray(arr), flat[name], err_msg=name)
        assert arr.dtype == jnp.float32
        assert arr.sharding.is_equivalent_to(expected[name], arr.ndim), name
    assert got["layers.0.attn.wq"].sharding.spec == P(None, "tp", None)
    assert got["layers.1.mlp.w_down"].addressable_shards[0].data.shape == (64 // 4, 32)
    # the placement equals shard_model's
    placed = flat_state(sharding.shard_model(tiny_model(cfg, seed=3), mesh))
    for name, arr in placed.items():
        assert arr.sharding.is_equivalent_to(got[name].sharding, arr.ndim), name




_COLLECTIVE = re.compile(r"=\s*(.*?)\s(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                         r"(?:-start)?\(")


def collectives(hlo: str) -> list[tuple[str, int]]:
    """(op, elements of its output) of every collective in an optimized HLO text."""
    out = []
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if m:
            shapes = re.findall(r"\[([\d,]*)\]", m.group(1))
            out.append((m.group(2), sum(int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes)))
    return out


def test_collectives_of_a_decode_step():
    """TP moves activations, never weights: greedy decode = one all-reduce of [B, E] for the
    embedding lookup and after attention and MLP of every layer, plus the vocab-sharded argmax
    (per-shard max and index, [B, tp] each). Sampling also gathers the logits [B, V] (top-p sort)."""
    cfg, tp = config("gqa"), 4
    B, E, V = SLOTS, cfg.hidden_size, cfg.vocab_size
    mesh = mesh_of(tp)
    steps, weights = decode.compile_steps(*nnx.split(sharding.shard_model(tiny_model(cfg, seed=0), mesh)))
    state = _state(cfg, mesh)
    slots, active = jnp.arange(SLOTS, dtype=jnp.int32), jnp.ones((SLOTS,), bool)
    samp = SamplingArrays(jnp.full((B,), 0.8), jnp.full((B,), 0.9), jnp.zeros((B,), jnp.int32),
                          jnp.zeros((B,), jnp.uint32))

    def ops(stochastic):
        return collectives(steps.decode.lower(weights, state, slots, active, samp, stochastic=stochastic)
                           .compile().as_text())
    greedy = ops(False)
    assert {op for op, _ in greedy} == {"all-reduce", "all-gather"}
    assert sum(n for op, n in greedy if op == "all-reduce") == (1 + 2 * cfg.num_layers) * B * E
    assert all(n <= B * tp for op, n in greedy if op == "all-gather")
    assert max(n for _, n in ops(True)) <= B * V
