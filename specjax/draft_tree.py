"""Growing the next draft tree inside the fused step (specjax.step), level by level from the draft's
output at the root (EAGLE-2: each level's k best of the frontier's children; topk = 1 is a chain), and
the draft's extend over accepted tokens.

    extend(info, draft, target, kv, pt, ps, tokens [B, T], feats, start [B], n [B])
        -> (hidden at the last new entry [B, E], its logits [B, Vd], kv)
    grow(info, spec, draft, target, kv, pt, ps, act, root [B], L, Ld, h_last [B, E], logits_last [B, Vd], ...)
        -> (Tree, draft_probs [B, N, V] or None, kv)

Grammar drafts force the first levels (grammar_levels, force_level); device DFAs mask each level's draft
logits (draft_vocab_view, mask_draft). The tree's nodes are the candidates' scratch entries in the
draft's cache (Ld + s * k + f at level s), their ancestors a [B, k, W] mask that the draft's attention
reads as its block mask.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import drafter, sampling, tree as tree_lib, verify
from specjax import device_dfa as dfa_lib
from specjax import penalties as pen_lib
from specjax import topk as topk_lib
from specjax.kv_cache import meta_at
from specjax.sampling import SamplingArrays

_DRAFT_SEED_SALT = 0x5BD1E995  # draft sampling uses its own random stream
_DISPLACED = -1e30  # score of the tree candidates a grammar draft displaces (never kept before real ones)


def _draft_keys(samp: SamplingArrays, pos):
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s ^ _DRAFT_SEED_SALT), p))(samp.seed, pos)


def extend(info, draft, target, kv, pt, ps, tokens, feats, start, n):
    """Draft over n[b] (<= T) new entries at draft index start[b]. tokens [B, T].
    Returns (hidden at the last new entry [B, E], its logits [B, Vd], kv)."""
    T = tokens.shape[1]
    pos = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    hid, kv = drafter.forward(info, draft, target, tokens, pos, feats, kv, pt, meta_at(pt, start, n, T, ps))
    last = jnp.clip(n - 1, 0, T - 1)
    h_last = jnp.take_along_axis(hid, last[:, None, None], axis=1)  # [B, 1, E]
    return h_last[:, 0], drafter.logits(info, draft, target, h_last)[:, 0], kv


def _pick_chain(info, draft, logits, samp, pos, vocab_size, sample_drafts):
    """Chain drafting: argmax, or (sample_drafts) a sample of the filtered draft distribution q.
    Returns (draft-vocab token [B], q over the target vocab [B, V] or None)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not sample_drafts:
        return greedy, None
    unfiltered = isinstance(sample_drafts, str) and sample_drafts == sampling.UNFILTERED  # no top-k / top-p row
    q = verify.filtered_probs(logits, samp, unfiltered)  # [B, Vd]; one-hot argmax for greedy rows
    drawn = jax.vmap(jax.random.categorical)(_draft_keys(samp, pos), jnp.log(q)).astype(jnp.int32)
    tok = jnp.where(samp.temperature > 0, drawn, greedy)
    return tok, drafter.probs_to_target(info, draft, q, vocab_size)


def draft_vocab_view(info, draft, dv, vd: int):
    """The DFA view that masks the draft's logits over its vocabulary of vd ids: dv itself where the
    draft shares the target's; for an EAGLE-3 head the tables' token classes read through its draft ->
    target id map (cls [M, Vd])."""
    if info.method != "eagle3":
        return dv
    return dv._replace(cls=dv.cls[:, drafter.to_target(info, draft, jnp.arange(vd, dtype=jnp.int32))])


def mask_draft(info, lp, mv, states):
    """Draft log-probs lp [B, F, Vd] masked by the frontier's DFA states [B, F]. An EAGLE-3 head's
    reduced vocabulary may hold none of the tokens a state allows: such a node keeps its unmasked
    law (its drafts are rejected by the masked target; a sampled chain's proposal q is the law it
    drew from either way, so verification stays exact)."""
    masked = dfa_lib.mask_logits(lp, mv, states)
    if info.method != "eagle3":
        return masked
    return jnp.where(jnp.any(masked > -jnp.inf, axis=-1, keepdims=True), masked, lp)


def grammar_levels(drafts, node, bonus, num_steps: int):
    """The first levels of the next tree that the grammar drafts (specjax.grammar_drafts).

    drafts [B, N', S + 1] int32: the grammar's continuation after each node of the verified tree
    (after the prompt for a prefill: N' = 1), -1 padded; node [B] int32: the node the accepted path
    ends at; bonus [B] int32: the next root. -> [B, S] int32: drafts[node, 1:] where drafts[node, 0]
    is the bonus (the continuation starts with the token the target chose), -1 from the first level
    without a grammar draft on (a prefix of the levels)."""
    g = jnp.take_along_axis(drafts, node[:, None, None], axis=1)[:, 0]  # [B, S + 1]
    lv = g[:, 1:num_steps + 1]  # [B, S]
    on = (g[:, :1] == bonus[:, None]) & (bonus[:, None] >= 0) & (jnp.cumprod(lv >= 0, axis=1) > 0)
    return jnp.where(on, lv, -1)


def force_level(spec, s, forced, tok, sc, q):
    """Level s of the tree growth with the grammar's token forced[:, s] (>= 0) where there is one:
    a chain's token (its proposal q the one-hot of it); a tree's only candidate of the level
    (candidate 0, a child of frontier node 0, i.e. of the forced node above; score 0, the others
    displaced). tok / sc [B, C] target ids / scores, q [B, V] or None -> (tok, sc, q)."""
    f = forced[:, s]  # [B]
    on = (f >= 0)[:, None]  # [B, 1]
    if spec.is_chain:
        if q is not None:
            q = jnp.where(on, jax.nn.one_hot(f, q.shape[-1], dtype=q.dtype), q)
        return jnp.where(on, f[:, None], tok), sc, q
    first = (jnp.arange(tok.shape[1]) == 0)[None, :]  # [1, C]
    tok = jnp.where(on & first, f[:, None], tok)
    sc = jnp.where(on, jnp.where(first, 0.0, _DISPLACED), sc)
    return tok, sc, q


def take(x, idx):
    """x [B, F, ...] at idx [B, k(, 1...)] along axis 1. The indices of a tree's growth (frontier picks,
    parents) are in range by construction: clipped, not jnp's default fill, whose bounds checks and fills
    were kernels of their own on a GPU (SmolLM2's fused step: 7 fewer, scripts/count_step_kernels.py)."""
    return jnp.take_along_axis(x, idx, axis=1, mode="clip")


def grow(info, spec, draft, target, kv, pt, ps, act, root, L, Ld, h_last, logits_last, samp,
         sample_drafts, pen_rows=None, forced=None, dfa=None, topk_impl: str = "xla"):
    """Grow the next tree from the draft's output at the root (h_last [B, E], logits_last [B, Vd]).
    pen_rows: penalty rows of the batch (counts including the root) to draft from penalised logits.
    forced: [B, S] int32 grammar drafts of the first levels (grammar_levels; -1: the draft's own
    choice), fed to the draft like its own tokens. dfa: (device_dfa.DFAView, the roots' states [B]):
    the draft drafts from its logits masked by each frontier node's DFA state (an EAGLE-3 head in its
    own vocabulary: draft_vocab_view; the proposals q of a sampled chain are those masked laws, so
    verification stays exact). topk_impl: the top-k of each level (specjax.topk; Kernels.draft_topk).
    Returns (Tree, draft_probs [B, N, V] or None, kv)."""
    S, k = spec.num_steps, spec.topk
    B = root.shape[0]
    V = target.embed[...].shape[0]
    W = max(1, (S - 1) * k)  # scratch entries of one tree
    feat = h_last[:, None]  # [B, F, E] features of the frontier's parents (the root: F = 1)
    anc = jnp.zeros((B, 1, W), bool)  # scratch ancestors of the frontier's parents
    score = jnp.zeros((B, 1), jnp.float32)
    if pen_rows is not None:
        logits_last = pen_lib.apply(logits_last, pen_rows)
    # "reduce" without DFA masks, in a tree: each level's k best and its log-softmax in one reduction
    # (specjax.topk.top_k_log_softmax), the [B, F, Vd] log-probs never written; else the log-probs
    fused = topk_impl == "reduce" and dfa is None and not spec.is_chain

    def level(lg):  # [B, F, Vd] logits -> (log-probs [B, F, k], ids [B, F, k]) if fused, else log-probs
        return topk_lib.top_k_log_softmax(lg, k, "reduce") if fused else jax.nn.log_softmax(lg, axis=-1)
    lp = level(logits_last[:, None])  # [B, 1, Vd] (or the root's k best)
    if dfa is not None:
        dv, fstate = dfa[0], dfa[1][:, None]  # [B, F] DFA states of the frontier nodes
        mv = draft_vocab_view(info, draft, dv, lp.shape[-1])
        lp = mask_draft(info, lp, mv, fstate)
    path = jnp.zeros((B, 1, 0), jnp.int32)  # target tokens below the root on the frontier's paths
    st_tok, st_score, st_par, qs = [], [], [], []
    fr = jnp.zeros((B, 1), jnp.int32)  # frontier: indices into the previous step's candidates
    kv_end = jnp.where(act > 0, Ld + W, 0)  # [B] the draft cache's end after the last level (rows that draft)
    for s in range(S):
        if fused:
            tok, sc, local = tree_lib.expand_top(score, *lp)  # [B, F*k] draft ids, scores, frontier idx
        else:
            tok, sc, local = tree_lib.expand_step(score, lp, k, topk_impl)
        q = None
        if spec.is_chain:  # F = k = 1
            tok, q = _pick_chain(info, draft, lp[:, 0], samp, L + s + 1, V, sample_drafts)
            tok = tok[:, None]
        tok = drafter.to_target(info, draft, tok)
        if forced is not None:
            tok, sc, q = force_level(spec, s, forced, tok, sc, q)
        if dfa is not None:  # [B, F*k] the candidates' states
            cstate = dfa_lib.step_states(dv, take(fstate, local), tok)
        if spec.is_chain:
            qs.append(q)
        st_tok.append(tok)
        st_score.append(sc)
        st_par.append(take(fr, local) if s else jnp.full_like(local, -1))
        if s == S - 1:
            break
        # feed the k best candidates (depth s + 1) as scratch entries Ld + s*k + f
        fr = tree_lib.frontier(sc, k, topk_impl)  # [B, k]
        parent = take(local, fr)  # [B, k] index into the previous frontier
        own = jax.nn.one_hot(s * k + jnp.arange(k), W, dtype=bool)[None]  # [1, k, W]
        anc = take(anc, parent[:, :, None]) | own  # [B, k, W]
        feat = take(feat, parent[:, :, None])  # [B, k, E]
        ftok = take(tok, fr)  # [B, k]
        path = jnp.concatenate([take(path, parent[:, :, None]), ftok[:, :, None]], axis=2)
        score = take(sc, fr)
        pos = jnp.broadcast_to((L + s + 1 - info.shift)[:, None], (B, k))
        # every level's keys end at the tree's last scratch entry (where a row drafts): the entries past this
        # level's are no node's ancestors (their block-mask bits are 0), and the levels' attention bounds
        # are then one array
        meta = dataclasses.replace(meta_at(pt, Ld + s * k, act * k, k, ps, block_mask=anc, mask_start=Ld),
                                   kv_len=kv_end, offset=s * k)
        feat, kv = drafter.forward(info, draft, target, ftok, pos, feat, kv, pt, meta)  # [B, k, E]
        lg = drafter.logits(info, draft, target, feat)  # [B, k, Vd]
        if pen_rows is not None:
            lg = pen_lib.apply(lg, pen_rows, path)
        lp = level(lg)
        if dfa is not None:
            fstate = take(cstate, fr)  # [B, k]
            lp = mask_draft(info, lp, mv, fstate)
    if spec.is_chain:
        tree = tree_lib.chain_tree(root, jnp.concatenate(st_tok, axis=1))
        probs = None
        if sample_drafts:
            probs = jnp.stack([jnp.zeros_like(qs[0])] + qs, axis=1)  # [B, N, V]; node 0 unused
    else:
        tree = tree_lib.select_tree(root, st_tok, st_score, st_par, spec.num_draft_tokens)
        probs = None
    return tree, probs, kv
