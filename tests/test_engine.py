"""Engine (continuous batching over a paged cache) against a naive full-recompute reference.

The reference is a dense, cache-free jnp forward of the same weights written out here from the
model's flat parameters (so it shares no attention/cache code with the engine): every step
recomputes the whole sequence and takes the logits of its last token."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import IdTokenizer, tiny_config, tiny_model
from specjax.engine import BatchOptions, CacheOptions, Engine
from specjax.models.llama import flat_state
from specjax.request import Request
from specjax.sampling_params import SamplingParams

MAX_SEQ = 64
MAX_BATCH = 3
MAX_TOKENS = 10
PROMPT_LENS = (1, 40, 7, 16, 17, 3, 33, 12, 25, 9)


# ----------------------------------------------------------------- dense reference

def _rms(x, scale, eps):
    return scale * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope(x, inv_freq):  # x [N, S, heads, D]; rotate-half with positions 0..S-1
    ang = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [S, D/2]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def make_dense(cfg, params):
    """jitted tokens [N, S] -> logits [N, S, V] (causal, positions 0..S-1, float32)."""
    assert cfg.rope.kind == "default" and not cfg.qkv_bias and not cfg.qk_norm and cfg.sliding_window is None
    D, G = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    inv_freq = 1.0 / (cfg.rope.theta ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
    eps = cfg.rms_norm_eps

    @jax.jit
    def dense(p, tokens):
        S = tokens.shape[1]
        x = p["embed"][tokens]
        causal = jnp.tril(jnp.ones((S, S), bool))
        for i in range(cfg.num_layers):
            pre = f"layers.{i}."
            h = _rms(x, p[pre + "attn_norm.scale"], eps)
            q = _rope(jnp.einsum("nse,ehd->nshd", h, p[pre + "attn.wq"]), inv_freq)
            k = _rope(jnp.einsum("nse,ekd->nskd", h, p[pre + "attn.wk"]), inv_freq)
            v = jnp.einsum("nse,ekd->nskd", h, p[pre + "attn.wv"])
            k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)  # head h uses kv head h // G
            s = jnp.einsum("nthd,nshd->nhts", q, k) / np.sqrt(D)
            s = jnp.where(causal[None, None], s, -jnp.inf)
            o = jnp.einsum("nhts,nshd->nthd", jax.nn.softmax(s, axis=-1), v)
            x = x + jnp.einsum("nthd,hde->nte", o, p[pre + "attn.wo"])
            h = _rms(x, p[pre + "mlp_norm.scale"], eps)
            x = x + (jax.nn.silu(h @ p[pre + "mlp.w_gate"]) * (h @ p[pre + "mlp.w_up"])) @ p[pre + "mlp.w_down"]
        x = _rms(x, p["norm.scale"], eps)
        w = p["embed"].T if cfg.tie_word_embeddings else p["lm_head"]
        return x @ w

    return functools.partial(dense, {k: jnp.asarray(v, jnp.float32) for k, v in params.items()})


class Reference:
    def __init__(self, cfg, model):
        self.cfg = cfg
        self.dense = make_dense(cfg, flat_state(model))

    def logits_along(self, seqs: list[list[int]], starts: list[int]) -> list[np.ndarray]:
        """Teacher forcing: for each seq, the logits [len(seq) - start, V] predicting seq[start:]
        (plus the next token), i.e. the logits at positions start-1 .. len-1."""
        toks = np.zeros((len(seqs), MAX_SEQ), np.int32)
        for n, s in enumerate(seqs):
            toks[n, : len(s)] = s  # zero padding after the sequence is invisible (causal)
        lg = np.asarray(self.dense(jnp.asarray(toks)), np.float64)
        return [lg[n, st - 1: len(s)] for n, (s, st) in enumerate(zip(seqs, starts))]

    def greedy(self, prompts: list[list[int]], n: int):
        """Full-recompute greedy: (tokens per prompt, logits [n, V] per prompt at each step)."""
        seqs = [list(p) for p in prompts]
        steps: list[list[np.ndarray]] = [[] for _ in prompts]
        for _ in range(n):
            toks = np.zeros((len(seqs), MAX_SEQ), np.int32)
            for i, s in enumerate(seqs):
                toks[i, : len(s)] = s
            lg = np.asarray(self.dense(jnp.asarray(toks)), np.float64)
            for i, s in enumerate(seqs):
                row = lg[i, len(s) - 1]
                steps[i].append(row)
                s.append(int(np.argmax(row)))
        return [s[len(p):] for s, p in zip(seqs, prompts)], [np.stack(x) for x in steps]


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


# ----------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config()
    model = tiny_model(cfg)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 96, size=n)] for n in PROMPT_LENS]
    ref = Reference(cfg, model)
    greedy_tokens, greedy_logits = ref.greedy(prompts, MAX_TOKENS)
    return cfg, model, prompts, ref, greedy_tokens, greedy_logits


def _engine(setup, page_size: int) -> Engine:
    cfg, model = setup[0], setup[1]
    return Engine(model, cfg, CacheOptions(page_size=page_size, max_seq_len=MAX_SEQ),
                  BatchOptions(max_batch=MAX_BATCH), jnp.float32)


@pytest.fixture(scope="module")
def eng16(setup):
    return _engine(setup, 16)


@pytest.fixture(scope="module")
def eng1(setup):
    return _engine(setup, 1)


def make_requests(prompts, params, seeds=None, ids=None):
    ids = list(range(len(prompts))) if ids is None else ids
    seeds = [0] * len(prompts) if seeds is None else seeds
    ps = params if isinstance(params, list) else [params] * len(prompts)
    return [Request(i, None, p, sp, IdTokenizer(), (96,), MAX_SEQ, s) for i, p, sp, s in zip(ids, prompts, ps, seeds)]


def run(eng, reqs):
    eng.run(reqs)
    assert all(r.finished for r in reqs)
    assert_clean(eng)
    return reqs


def assert_clean(eng):
    """After a run: every page back on the free list (page 0 is never handed out), no slot busy."""
    num_pages = int(eng.state.cache.kv[0].shape[0])
    assert eng.alloc.num_free == num_pages - 1
    assert eng.alloc.unused_pages() == list(range(1, num_pages))  # no page lost or duplicated (cached ones too)
    assert all(s is None for s in eng.slots)
    assert all(not o for o in eng.alloc.owned)


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, top_k=20, ignore_eos=True)


# ----------------------------------------------------------------- tests

def test_reference_is_not_degenerate(setup):
    """The random model must produce varied greedy continuations, else the tests prove little."""
    greedy_tokens = setup[4]
    assert len({tuple(t) for t in greedy_tokens}) == len(greedy_tokens)
    assert all(len(set(t)) >= 3 for t in greedy_tokens)


@pytest.mark.parametrize("page_size", [16, 1])
def test_batched_greedy_matches_reference(setup, page_size, request):
    """>= 8 ragged prompts through 3 slots (slots are freed and reused) == per-prompt reference;
    page sizes 16 and 1 give the same tokens."""
    prompts, greedy_tokens = setup[2], setup[4]
    eng = request.getfixturevalue(f"eng{page_size}")
    reqs = run(eng, make_requests(prompts, GREEDY))
    for r, want in zip(reqs, greedy_tokens):
        assert r.token_ids == want, (r.id, len(r.prompt_ids))
        assert r.finish_reason == "length"


def test_page_sizes_agree_when_sampling(setup, eng1, eng16):
    prompts = setup[2]
    seeds = [50 + i for i in range(len(prompts))]
    a = run(eng1, make_requests(prompts, SAMPLED, seeds))
    b = run(eng16, make_requests(prompts, SAMPLED, seeds))
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_each_prompt_alone_matches_batch(setup, eng16):
    prompts, greedy_tokens = setup[2], setup[4]
    eng = eng16
    for i, p in enumerate(prompts):
        (r,) = run(eng, make_requests([p], GREEDY, ids=[i]))
        assert r.token_ids == greedy_tokens[i], i


def test_mixed_lengths_in_one_batch(setup, eng16):
    """Requests with different max_tokens finish at different steps; the others keep going."""
    prompts, greedy_tokens = setup[2], setup[4]
    eng = eng16
    params = [SamplingParams(max_tokens=1 + (i * 3) % MAX_TOKENS, temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
    reqs = run(eng, make_requests(prompts, params))
    for r, sp, want in zip(reqs, params, greedy_tokens):
        assert r.token_ids == want[: sp.max_tokens]


def allowed_set(logits, temperature, top_p, top_k):
    """Brute force: token ids a temperature/top-k/top-p sampler may return (top-p over the
    renormalized top-k; a token is kept while the mass ranked strictly before it is < top_p)."""
    z = logits / temperature
    order = np.argsort(-z, kind="stable")[:top_k]
    p = np.exp(z[order] - z[order].max())
    p /= p.sum()
    before = np.cumsum(p) - p
    keep = (before < top_p + 1e-5) | (np.arange(len(order)) == 0)  # tolerance only widens the set
    return {int(t) for t in order[keep]}


def test_sampling_batch_invariant_reproducible_and_filtered(setup, eng16):
    prompts, ref, greedy_tokens = setup[2], setup[3], setup[4]
    eng = eng16
    seeds = [1000 + i for i in range(len(prompts))]
    # sampled requests mixed with greedy ones
    params = [SAMPLED if i % 3 else GREEDY for i in range(len(prompts))]
    batch = run(eng, make_requests(prompts, params, seeds))
    again = run(eng, make_requests(prompts[::-1], params[::-1], seeds[::-1]))[::-1]
    assert [r.token_ids for r in batch] == [r.token_ids for r in again]
    for i in (1, 2, 4):
        (alone,) = run(eng, make_requests([prompts[i]], SAMPLED, [seeds[i]]))
        assert alone.token_ids == batch[i].token_ids, i
    sampled = [i for i in range(len(prompts)) if i % 3]
    for i in range(len(prompts)):
        if i not in sampled:
            assert batch[i].token_ids == greedy_tokens[i]
    assert any(batch[i].token_ids != greedy_tokens[i] for i in sampled), "sampling never left the argmax"
    # a different seed changes something
    other = run(eng, make_requests([prompts[i] for i in sampled], SAMPLED, [s + 1 for s in range(len(sampled))]))
    assert [r.token_ids for r in other] != [batch[i].token_ids for i in sampled]
    # every sampled token lies in the top-k / top-p set of the reference distribution
    seqs = [prompts[i] + batch[i].token_ids for i in sampled]
    logits = ref.logits_along(seqs, [len(prompts[i]) for i in sampled])
    for n, i in enumerate(sampled):
        for j, tok in enumerate(batch[i].token_ids):
            assert tok in allowed_set(logits[n][j], 0.8, 0.9, 20), (i, j)


def test_logprobs(setup, eng16):
    prompts, ref, greedy_tokens, greedy_logits = setup[2], setup[3], setup[4], setup[5]
    eng = eng16
    K = 5
    idx = [0, 1, 2, 3, 5]
    greedy_lp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=K)
    sampled_lp = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.5, ignore_eos=True, logprobs=2)
    params = [greedy_lp, sampled_lp, greedy_lp, sampled_lp, SamplingParams(max_tokens=4, temperature=0.0,
                                                                           ignore_eos=True)]
    reqs = run(eng, make_requests([prompts[i] for i in idx], params, seeds=[7] * len(idx)))
    assert reqs[4].logprobs is None
    checked_non_top = 0
    for r, i, sp in zip(reqs[:4], idx, params):
        assert len(r.logprobs) == len(r.token_ids) == MAX_TOKENS
        if sp.greedy:
            assert r.token_ids == greedy_tokens[i]
            logits = greedy_logits[i]
        else:
            logits = ref.logits_along([prompts[i] + r.token_ids], [len(prompts[i])])[0]
        lp = log_softmax(logits)
        for j, (tok, entry) in enumerate(zip(r.token_ids, r.logprobs)):
            assert abs(entry[tok] - lp[j, tok]) < 1e-4, (i, j)
            top = np.argsort(-lp[j])[: sp.logprobs]
            assert set(entry) == set(int(t) for t in top) | {tok}, (i, j)
            for t in top:
                assert abs(entry[int(t)] - lp[j, t]) < 1e-4
            checked_non_top += tok not in top
    assert checked_non_top > 0, "no sampled token outside the top logprobs: the chosen-entry path is untested"


@pytest.mark.parametrize("steps_per_call", [1, 8])
def test_single_slot_engine_and_steps_per_call(setup, steps_per_call):
    """max_batch=1 (decode runs with a padding row) and 1 or 8 steps per dispatch: same tokens."""
    cfg, model, prompts, greedy_tokens = setup[0], setup[1], setup[2], setup[4]
    eng = Engine(model, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ),
                 BatchOptions(max_batch=1, steps_per_call=steps_per_call), jnp.float32)
    reqs = run(eng, make_requests(prompts[:4], GREEDY))
    assert [r.token_ids for r in reqs] == greedy_tokens[:4]


def test_no_step_past_a_certain_end(setup):
    """The host reads one step behind; a request that the dispatched steps certainly finish (at
    least `sure` more tokens reach max_tokens) is not stepped again: 16 tokens at 8 steps per
    dispatch take the prefill and two decode dispatches (a third ran past the end before)."""
    cfg, model, prompts = setup[0], setup[1], setup[2]
    eng = Engine(model, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ),
                 BatchOptions(max_batch=1, steps_per_call=8), jnp.float32)
    calls = []
    decode = eng.steps.decode_many
    eng.steps = eng.steps._replace(decode_many=lambda *a, **kw: calls.append(kw["num_steps"]) or decode(*a, **kw))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone = run(eng, make_requests(prompts[:1], params))
    assert calls == [8, 8] and len(alone[0].token_ids) == 16
    calls.clear()
    both = run(eng, make_requests(prompts[:2], params))  # the second waits for the slot: no idle dispatch
    assert calls == [8, 8, 8, 8] and both[0].token_ids == alone[0].token_ids
    assert int(eng.sched.sure.sum()) == 0 and int(eng.sched.inflight.sum()) == 0


def test_cache_too_small_fails_the_request_instead_of_hanging(setup):
    """A request that can never fit the cache fails on its own (finish_reason "error"); one that
    fits runs normally beside it."""
    cfg, model, prompts, greedy_tokens = setup[0], setup[1], setup[2], setup[4]
    eng = Engine(model, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ, num_pages=6),
                 BatchOptions(max_batch=2, steps_per_call=2), jnp.float32)
    big, small = run(eng, make_requests([prompts[1], prompts[5]], GREEDY))  # 40 tokens need 11 pages of 4
    assert big.finish_reason == "error" and "KV pages" in big.error and big.token_ids == []
    assert small.finish_reason == "length" and small.token_ids == greedy_tokens[5]
