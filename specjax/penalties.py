"""Repetition, frequency and presence penalties, kept per slot on the device; also under speculation.

Semantics (those of the OpenAI API, as vLLM implements them)
------------------------------------------------------------
For one request, let ``P`` be the set of its prompt tokens and ``c(t)`` the number of times token
``t`` occurs in the output generated so far. Before anything else touches the model's logits
(temperature, top-k, top-p, the greedy argmax, a grammar mask), in this order:

* repetition penalty ``r > 0`` (1 = off): every token in ``P`` or with ``c(t) > 0`` has its logit
  divided by ``r`` when it is positive and multiplied by ``r`` otherwise (``r > 1`` makes repeats
  less likely, ``r < 1`` more likely);
* frequency penalty ``f``: the logit of ``t`` goes down by ``f * c(t)``;
* presence penalty ``p``: the logit of ``t`` goes down by ``p`` when ``c(t) > 0``.

Only the frequency and presence penalties look at output counts alone; the repetition penalty
also covers the prompt. With ``r = 1, f = p = 0`` every logit comes back bit for bit, so a batch
may mix penalised and plain rows. Reported logprobs stay those of the raw model distribution.

State
-----
:class:`PenaltyState` holds, per slot, the prompt's token set, the output counts and the three
parameters. :func:`set_slots` (at prefill) resets a slot; :func:`add_tokens` counts newly emitted
tokens. A preempted request is prefilled again with its prompt *and* the tokens it had generated:
``PenaltyParams.prompt_len`` says where its prompt ends, and the tokens after it are counted as
output again, so the request keeps exactly the penalty state it had. The counts of a slot always include *every* token emitted so far, the newest one too: the
token that the next plain decode step feeds, which is also the root (node 0) of the next draft tree.
So the logits a step computes after feeding that token are penalised with the counts as they are.

Draft trees
-----------
The target's logits after tree node ``i`` are the ones plain decoding would compute after emitting
the tokens on the path from the root to ``i``. The root is already counted, so node ``i`` needs the
state's counts plus one count per token of the nodes on its path *below* the root, ``i`` included:
:func:`tree_path_tokens` lists them, ``[B, N, D]`` with ``D = max_depth`` (-1 padded; the root has
none). Acceptance then sees exactly plain decoding's penalised distributions, and the bonus token
after the last accepted node is drawn from that node's penalised logits. :func:`apply` penalises
every node with the state's counts (dense over V) and then rewrites only the at most ``D`` entries
per node whose counts the path changes, so no ``[B, N, V]`` count array is ever built.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PenaltyState:
    """Per-slot penalty state (or its rows gathered for a batch: leading axis B instead of slots)."""
    prompt_mask: jax.Array  # [max_slots, V] bool: token occurs in the prompt
    out_counts: jax.Array  # [max_slots, V] int32: occurrences in the output emitted so far
    rep: jax.Array  # [max_slots] float32 repetition penalty (1 = off)
    freq: jax.Array  # [max_slots] float32 frequency penalty (0 = off)
    pres: jax.Array  # [max_slots] float32 presence penalty (0 = off)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PenaltyParams:
    """The penalties of the rows of one prefill batch."""
    repetition: jax.Array  # [B] float32
    frequency: jax.Array  # [B] float32
    presence: jax.Array  # [B] float32
    prompt_len: jax.Array | None = None  # [B] int32: the prefilled tokens past it are earlier output
    #                                      (a preempted request); None: every prefilled token is prompt


def init_penalty_state(max_slots: int, vocab_size: int) -> PenaltyState:
    """Every slot neutral: empty prompt set, zero counts, penalties off."""
    return PenaltyState(prompt_mask=jnp.zeros((max_slots, vocab_size), bool),
                        out_counts=jnp.zeros((max_slots, vocab_size), jnp.int32),
                        rep=jnp.ones((max_slots,), jnp.float32), freq=jnp.zeros((max_slots,), jnp.float32),
                        pres=jnp.zeros((max_slots,), jnp.float32))


def penalty_params(params, prompt_lens=None) -> PenaltyParams:
    """Host helper: PenaltyParams from a list of SamplingParams (None rows, e.g. padding: off).
    prompt_lens: the rows' prompt lengths when a prefill also holds generated tokens (None: all prompt)."""
    def col(name, off):
        return jnp.asarray(np.array([off if p is None else getattr(p, name) for p in params], np.float32))
    plen = None if prompt_lens is None else jnp.asarray(np.array(prompt_lens, np.int32))
    return PenaltyParams(repetition=col("repetition_penalty", 1.0), frequency=col("frequency_penalty", 0.0),
                         presence=col("presence_penalty", 0.0), prompt_len=plen)


def set_slots(state: PenaltyState, slots, tokens, lens, params: PenaltyParams | None = None) -> PenaltyState:
    """A prefill of the rows slots [B] with tokens [B, T] (right-padded, lens [B]): the slot's
    prompt set becomes the first params.prompt_len[b] tokens (all lens[b] when None), its output
    counts those of the tokens after them (none for a fresh request), its penalties are set
    (params None: off). Rows whose slot is >= max_slots are padding (dropped)."""
    B, T = tokens.shape
    V = state.prompt_mask.shape[1]
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    plen = lens if params is None or params.prompt_len is None else jnp.minimum(params.prompt_len, lens)
    in_prompt = t < plen[:, None]  # [B, T]
    rows_ = jnp.arange(B)[:, None]
    mask = jnp.zeros((B, V), bool).at[rows_, jnp.where(in_prompt, tokens, V)].set(True, mode="drop")
    out = (t < lens[:, None]) & ~in_prompt  # generated before a preemption
    counts = jnp.zeros((B, V), jnp.int32).at[rows_, jnp.where(out, tokens, V)].add(1, mode="drop")

    def put(arr, val):
        return arr.at[slots].set(val, mode="drop")
    if params is None:
        rep, freq, pres = 1.0, 0.0, 0.0
    else:
        rep, freq, pres = params.repetition, params.frequency, params.presence
    return PenaltyState(prompt_mask=put(state.prompt_mask, mask), out_counts=put(state.out_counts, counts),
                        rep=put(state.rep, rep), freq=put(state.freq, freq), pres=put(state.pres, pres))


def add_tokens(state: PenaltyState, slots, tokens, counts) -> PenaltyState:
    """Count the first counts[b] of tokens [B, K] as output of slot slots[b] (negative tokens and
    slots >= max_slots are ignored)."""
    K = tokens.shape[1]
    V = state.out_counts.shape[1]
    valid = (jnp.arange(K, dtype=jnp.int32)[None, :] < counts[:, None]) & (tokens >= 0)
    cols = jnp.where(valid, tokens, V)
    out_counts = state.out_counts.at[slots[:, None], cols].add(1, mode="drop")
    return dataclasses.replace(state, out_counts=out_counts)


def rows(state: PenaltyState, slots) -> PenaltyState:
    """The state of the rows slots [B] (padding rows >= max_slots read the last slot)."""
    idx = jnp.minimum(slots, state.rep.shape[0] - 1)
    return jax.tree.map(lambda a: a[idx], state)


def _penalize(x, seen, count, rep, freq, pres):
    """The three penalties on logits x (all arguments broadcast together; count int32)."""
    r = jnp.where(seen, rep, 1.0)
    x = jnp.where(x > 0, x / r, x * r)
    return x - freq * count.astype(jnp.float32) - pres * (count > 0).astype(jnp.float32)


def apply(logits, rows_: PenaltyState, path_tokens=None):
    """Penalised logits, same shape: logits [B, V] or [B, N, V] float32; rows_ the state rows of the
    batch (:func:`rows`). path_tokens: optional [B, D] / [B, N, D] int32, tokens emitted after those
    the state counts (one list per logits row, -1 padded; e.g. :func:`tree_path_tokens`)."""
    x = logits.astype(jnp.float32)
    B, V = x.shape[0], x.shape[-1]
    mid = (1,) * (x.ndim - 2)

    def vec(a):  # [B] -> [B, 1.., 1]
        return a.reshape((B,) + mid + (1,))
    rep, freq, pres = vec(rows_.rep), vec(rows_.freq), vec(rows_.pres)
    seen = (rows_.prompt_mask | (rows_.out_counts > 0)).reshape((B,) + mid + (V,))
    count = rows_.out_counts.reshape((B,) + mid + (V,))
    out = _penalize(x, seen, count, rep, freq, pres)
    if path_tokens is None or path_tokens.shape[-1] == 0:
        return out
    D = path_tokens.shape[-1]
    xf, of = x.reshape(B, -1, V), out.reshape(B, -1, V)
    pt = path_tokens.reshape(B, -1, D).astype(jnp.int32)
    valid = pt >= 0
    t = jnp.maximum(pt, 0)
    b_idx = jnp.arange(B)[:, None, None]
    n_idx = jnp.arange(pt.shape[1])[None, :, None]
    raw = xf[b_idx, n_idx, t]  # [B, N, D] the raw logits of the path tokens
    extra = jnp.sum((pt[..., :, None] == pt[..., None, :]) & valid[..., None, :], axis=-1)  # same-token count
    c = rows_.out_counts[b_idx, t] + extra
    r3 = (rows_.rep[:, None, None], rows_.freq[:, None, None], rows_.pres[:, None, None])
    val = _penalize(raw, True, c, *r3)  # equal for equal tokens: duplicate writes agree
    of = of.at[b_idx, n_idx, jnp.where(valid, t, V)].set(val, mode="drop")
    return of.reshape(out.shape)


def tree_path_tokens(tree) -> jax.Array:
    """[B, N, D] int32 (D = tree.max_depth): for node i, the tokens of the nodes on the path from the
    root (excluded) down to i (included), by depth, -1 padded. The root's row is all -1."""
    N = tree.tokens.shape[1]
    D = tree.max_depth if tree.max_depth > 0 else N - 1
    want = jnp.arange(1, D + 1, dtype=jnp.int32)
    sel = tree.mask[..., None] & (tree.depth[:, None, :, None] == want)  # [B, N(i), N(j), D]
    tok = jnp.sum(jnp.where(sel, tree.tokens[:, None, :, None], 0), axis=2)
    return jnp.where(jnp.any(sel, axis=2), tok, -1).astype(jnp.int32)
