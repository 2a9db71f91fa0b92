"""Plain (non-speculative) prefill and decode steps: pure functions under jax.jit.

Every step is f(inputs, params, state, cfg) -> (outputs, state); `state` (KV cache and the
last token of each slot, optionally the penalty state) is donated and lives on the device,
indexed by slot. With `DecodeState.penalties` set, every sampled token is drawn from penalised
logits (specjax.penalties) and counted; without it the programs are those of no penalties.

A decode step is `decode_forward` (the forward over each row's last token: logits [B, V], K/V
appended, lengths advanced) then `decode_sample` (penalties, grammar masks, sampling, counts, last
tokens): one program in `decode` / `decode_many`, two for grammar batches, whose masks the host
computes while the forward runs (specjax.programs, specjax.engine). Grammar masks (`token_mask`)
are token_mask.RowMasks (the constrained rows only) or a dense bitmask.

Prefill works on pieces (`PrefillRows`): row b appends tokens[b, :lens[b]] at cache index start[b]
of its slot, attending to the slot's cached entries before start[b] (a shared prefix, earlier
chunks) and causally to its own new tokens. A row's `final` piece ends the prompt: it samples the
first output token; other pieces only fill the cache (chunked prefill).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import device_dfa as dfa_lib
from specjax import penalties as pen_lib
from specjax import sampling
from specjax.kv_cache import KVCache, meta_at, step_meta
from specjax.penalties import PenaltyParams, PenaltyState
from specjax.token_mask import apply_token_mask


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    cache: KVCache
    last_tokens: jax.Array  # [max_slots] int32: last sampled token of each slot
    penalties: PenaltyState | None = None  # None: no penalties (compiled out)
    dfa: dfa_lib.DFATables | None = None  # per-slot regex DFAs (specjax.device_dfa); None: none admitted yet


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillRows:
    """The rows of one prefill call (padding rows: lens 0, slot >= max_slots)."""
    tokens: jax.Array  # [B, T] int32 new tokens, right-padded
    start: jax.Array  # [B] int32 cache index (= position) of tokens[:, 0]; the cache holds what is before
    lens: jax.Array  # [B] int32 new tokens of each row
    slots: jax.Array  # [B] int32
    final: jax.Array  # [B] bool the prompt ends here: sample the first output token
    next_ids: jax.Array  # [B] int32 the prompt token after a non-final piece (a shifted draft reads it)
    regrow: jax.Array | None = None  # [B] bool a non-final piece ending before the slot's last token x_L
    #   (= next_ids): a speculative prefill grows a new tree rooted at it (specjax.spec_tiers); None: none


def whole_prompts(tokens, lens, slots) -> PrefillRows:
    """Rows that prefill whole prompts tokens [B, T] (lens [B]) from position 0."""
    zero = jnp.zeros_like(lens)
    return PrefillRows(tokens=tokens, start=zero, lens=lens, slots=slots, final=lens > 0, next_ids=zero)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOut:
    tokens: jax.Array  # [B] int32 sampled tokens
    logprob: jax.Array | None = None  # [B] float32 log p(token)
    top_logprobs: jax.Array | None = None  # [B, K] float32
    top_ids: jax.Array | None = None  # [B, K] int32


def _finish(model, h_last, samp, positions, want_logprobs, stochastic, pen_rows=None, token_mask=None,
            dfa_view=None):
    logits = model.logits(h_last[:, None, :])[:, 0]  # [B, V] float32
    return _sample(logits, samp, positions, want_logprobs, stochastic, pen_rows, token_mask, dfa_view)


def _sample(logits, samp, positions, want_logprobs, stochastic, pen_rows=None, token_mask=None, dfa_view=None):
    """Sample from logits [B, V] (penalised, then grammar-masked: token_mask a token_mask.RowMasks,
    a dense [B, W] bitmask or None; dfa_view: the rows' device DFAs, device_dfa.DFAView or None)."""
    sample_from = logits if pen_rows is None else pen_lib.apply(logits, pen_rows)
    sample_from = apply_token_mask(sample_from, token_mask)
    sample_from = dfa_lib.mask_logits(sample_from, dfa_view)
    tokens = sampling.sample(sample_from, samp, positions, stochastic)
    if not want_logprobs:  # logprobs: of the raw model distribution
        return StepOut(tokens)
    return StepOut(tokens, *sampling.token_logprobs(logits, tokens))


def prefill_penalties(pen: PenaltyState | None, tokens, lens, slots,
                      penalty_params: PenaltyParams | None) -> PenaltyState | None:
    """The penalty state with the prefilled slots reset (prompt set, zero counts, their penalties;
    None params: off). Penalty parameters without a penalty state are an error."""
    if pen is None:
        if penalty_params is not None:
            raise ValueError("penalty_params given but the state has no penalty state "
                             "(create it with penalties.init_penalty_state)")
        return None
    return pen_lib.set_slots(pen, slots, tokens, lens, penalty_params)


def count_first(pen: PenaltyState | None, slots, lens, first_tokens) -> PenaltyState | None:
    """Count the token sampled at prefill (rows with lens > 0) as the slots' first output."""
    if pen is None:
        return None
    return pen_lib.add_tokens(pen, slots, first_tokens[:, None], (lens > 0).astype(jnp.int32))


def target_prefill(model, cache: KVCache, rows: PrefillRows, samp, want_logprobs, stochastic,
                   aux_layers: tuple[int, ...] = (), pen: PenaltyState | None = None, token_mask=None,
                   dfa_view=None):
    """Prefill pieces into the target and sample after each row's last new token (shared by the
    plain and the speculative paths; only final rows' samples are used). pen: the penalty state
    (the slots already reset, prefill_penalties) or None; the caller counts the sampled token
    (count_first). dfa_view: the rows' device DFAs (their states after the prompt) or None.
    Returns (StepOut, h [B, T, E], aux hidden states, cache with the slots' lengths set to start + lens)."""
    B, T = rows.tokens.shape
    safe_slots = jnp.clip(rows.slots, 0, cache.seq_lens.shape[0] - 1)
    meta = meta_at(cache.page_table[safe_slots], rows.start, rows.lens, T, cache.page_size)
    positions = rows.start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    h, cache, aux = model(rows.tokens, positions, cache, meta, aux_layers)
    last = jnp.clip(rows.lens - 1, 0, T - 1)
    h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]  # [B, E]
    pen_rows = None if pen is None else pen_lib.rows(pen, safe_slots)
    out = _finish(model, h_last, samp, rows.start + rows.lens, want_logprobs, stochastic, pen_rows, token_mask,
                  dfa_view)
    cache = dataclasses.replace(cache, seq_lens=cache.seq_lens.at[rows.slots].set(rows.start + rows.lens, mode="drop"))
    return out, h, aux, cache


def final_slots(rows: PrefillRows, max_slots: int):
    """[B] the slots of the final rows; max_slots (dropped by updates) for the others."""
    return jnp.where(rows.final & (rows.lens > 0), rows.slots, max_slots)


def prefill_dfa(state, rows: PrefillRows, dfa: bool):
    """The prefill rows' device DFAs (DFAView; None: dfa off, the static flag)."""
    if not dfa:
        return None
    return dfa_lib.view(state.dfa, jnp.clip(rows.slots, 0, state.dfa.state.shape[0] - 1))


def prefill_dfa_advance(tables, view, fin, rows: PrefillRows, first_tokens):
    """The tables with the final rows' states (slots fin [B], max_slots for the others) advanced by
    their first sampled tokens [B] (tables unchanged when view is None)."""
    if view is None:
        return tables
    new = dfa_lib.advance(view, first_tokens, rows.final & (rows.lens > 0))
    return dataclasses.replace(tables, state=tables.state.at[fin].set(new, mode="drop"))


def prefill_rows(graphdef, params, state: DecodeState, rows: PrefillRows, samp, want_logprobs=False,
                 stochastic=True, token_mask=None, dfa=False):
    """Prefill pieces (token_mask: optional [B, W] grammar bitmask of the first token; dfa (static):
    the rows' device DFAs mask the first token and advance). The penalty state and the DFA tables of
    the admitted slots must already be written (prefill_penalties, device_dfa.admit). Final rows
    sample their first token. Returns (StepOut, state)."""
    model = nnx.merge(graphdef, params)
    pen = state.penalties
    v = prefill_dfa(state, rows, dfa)
    out, _, _, cache = target_prefill(model, state.cache, rows, samp, want_logprobs, stochastic, pen=pen,
                                      token_mask=token_mask, dfa_view=v)
    fin = final_slots(rows, state.last_tokens.shape[0])
    pen = count_first(pen, fin, rows.lens, out.tokens)
    last_tokens = state.last_tokens.at[fin].set(out.tokens, mode="drop")
    return out, DecodeState(cache, last_tokens, pen, prefill_dfa_advance(state.dfa, v, fin, rows, out.tokens))


def prefill(graphdef, params, state: DecodeState, tokens, lens, slots, samp, want_logprobs=False,
            stochastic=True, penalty_params: PenaltyParams | None = None, token_mask=None):
    """Prefill ragged prompts from position 0 (token_mask: optional [B, W] grammar bitmask).

    tokens: [B, T] int32 (right-padded); lens: [B] int32 (0 for padding rows);
    slots: [B] int32 (padding rows may hold any index >= max_slots). penalty_params: the rows'
    penalties (needs state.penalties; None: the slots' penalties are off). Returns (StepOut, state).
    """
    pen = prefill_penalties(state.penalties, tokens, lens, slots, penalty_params)
    return prefill_rows(graphdef, params, dataclasses.replace(state, penalties=pen), whole_prompts(tokens, lens, slots),
                        samp, want_logprobs, stochastic, token_mask)


def decode(graphdef, params, state: DecodeState, slots, active, samp, want_logprobs=False, stochastic=True,
           token_mask=None, dfa=False):
    """One decode step for the rows `slots` [B]: feeds each slot's last token, appends its K/V,
    samples the next token (token_mask: optional grammar masks, see _sample). Inactive rows ([B]
    bool) write to the trash page and do not advance;
    rows with slot >= max_slots are padding (a batch of >= 2 rows keeps XLA from rewriting the
    matmuls of a single row into multiply + reduce pairs, which is slower on GPU).
    = decode_forward, then decode_sample (the engine runs them as two programs under grammars, to
    compute the masks while the forward runs)."""
    model = nnx.merge(graphdef, params)
    positions = state.cache.seq_lens[jnp.minimum(slots, state.cache.seq_lens.shape[0] - 1)]  # [B]
    logits, state = decode_forward(model, state, slots, active)
    return decode_sample(state, logits, slots, active, samp, positions + 1, want_logprobs, stochastic, token_mask,
                         dfa)


def decode_forward(model, state: DecodeState, slots, active):
    """The forward half of a decode step: each row's last token at its slot's length, K/V appended,
    lengths advanced. -> (logits [B, V] float32 of the next token, state)."""
    cache = state.cache
    num_new = active.astype(jnp.int32)
    read_slots = jnp.minimum(slots, cache.seq_lens.shape[0] - 1)
    meta = step_meta(cache, read_slots, num_new, 1)
    positions = cache.seq_lens[read_slots]  # [B]
    tokens = state.last_tokens[read_slots]
    h, cache, _ = model(tokens[:, None], positions[:, None], cache, meta)
    logits = model.logits(h)[:, 0]  # [B, V] float32
    cache = dataclasses.replace(cache, seq_lens=cache.seq_lens.at[slots].add(num_new, mode="drop"))
    return logits, dataclasses.replace(state, cache=cache)


def decode_sample(state: DecodeState, logits, slots, active, samp, positions, want_logprobs=False, stochastic=True,
                  token_mask=None, dfa=False):
    """The sampling half of a decode step: the next token of each row from logits [B, V] (penalised,
    grammar-masked, DFA-masked when the static flag dfa is on; positions [B]: the sampled token's
    position, which keys the randomness), counted in the penalty state, stored as the slot's last
    token, its DFA state advanced. -> (StepOut, state)."""
    read_slots = jnp.minimum(slots, state.last_tokens.shape[0] - 1)
    pen = state.penalties
    pen_rows = None if pen is None else pen_lib.rows(pen, read_slots)
    v = dfa_lib.view(state.dfa, read_slots) if dfa else None
    out = _sample(logits, samp, positions, want_logprobs, stochastic, pen_rows, token_mask, v)
    last_tokens = state.last_tokens.at[slots].set(jnp.where(active, out.tokens, state.last_tokens[read_slots]),
                                                  mode="drop")
    if pen is not None:
        pen = pen_lib.add_tokens(pen, slots, out.tokens[:, None], active.astype(jnp.int32))
    tables = state.dfa
    if v is not None:
        tables = dataclasses.replace(tables, state=tables.state.at[slots].set(dfa_lib.advance(v, out.tokens, active),
                                                                               mode="drop"))
    return out, DecodeState(state.cache, last_tokens, pen, tables)


def decode_many(graphdef, params, state: DecodeState, slots, active, samp, num_steps: int,
                want_logprobs=False, stochastic=True, dfa=False):
    """num_steps decode steps in one program (one dispatch; dfa: the rows' device DFAs mask and
    advance at every step). -> (StepOut with [num_steps, B] fields, state)."""
    def body(state, _):
        out, state = decode(graphdef, params, state, slots, active, samp, want_logprobs, stochastic, dfa=dfa)
        return state, out
    state, outs = jax.lax.scan(body, state, None, length=num_steps)
    return outs, state


class Steps(NamedTuple):
    """The jitted steps of one model graph. Weights are passed as a flat list of arrays
    (cheap to dispatch); the graph definition is closed over, not hashed per call."""
    prefill: Callable
    decode: Callable
    decode_many: Callable


def compile_steps(graphdef, params) -> tuple[Steps, list]:
    """-> (Steps, weights): call steps.decode(weights, state, ...)."""
    leaves, treedef = jax.tree.flatten(params)

    def bind(fn):
        def run(weights, *args, **kw):
            return fn(graphdef, jax.tree.unflatten(treedef, weights), *args, **kw)
        return run

    jit = functools.partial(jax.jit, donate_argnums=(1,))  # run(weights, state, ...): state donated
    return Steps(
        prefill=jit(bind(prefill), static_argnames=("want_logprobs", "stochastic")),  # kw penalty_params
        decode=jit(bind(decode), static_argnames=("want_logprobs", "stochastic")),
        decode_many=jit(bind(decode_many), static_argnames=("num_steps", "want_logprobs", "stochastic")),
    ), leaves
