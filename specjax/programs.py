"""The engine's jitted programs: the steps of specjax.decode / specjax.step (step_prefill, step_lite) bound
to one model (graph definitions closed over, weights passed as flat lists), reading each row's sampling
parameters from per-slot device arrays and taking an optional grammar bitmask.

Per-slot sampling parameters (`SamplingArrays` of [max_slots]) are written by the prefill program
at admission and gathered by slot in every step, so the host sends no per-step parameters.
Speculative programs also return the rows' next draft trees (tokens, parents [B, N]), which the
host needs for grammar masks of the following step.

The speculative step exists fused (`step`: verify + accept + compact + draft, one program; up to K
of them per dispatch in one device loop, each row's stop ids and length limit (`StopRows`) checked on
the device after every step so that a finished row stops changing state, the loop ending once every
row has finished; with the static flag `lite`, K lite steps instead: step_lite.spec_lite_step, a plain step
that keeps the draft in sync, same call shape and output layout; K > 1 of them run the target's side
only, step_lite.spec_lite_target, and extend the draft over their K tokens once at the end,
step_lite.lite_draft_sync: one draft forward per dispatch instead of one per step; with `lazy` too, plain
decoding's steps that leave an EAGLE head's draft behind: specjax.lazy_draft) and split
(`verify` | `finish`) so that a grammar batch can compute its tree masks on the host while the target
forward runs. `verify` donates the state and hands it back with the tree's K/V written (no copy of the
cache); `finish` takes it with the logits and the masks. Plain decoding likewise:
`decode_many` (num_steps steps in one program) and, for grammar batches, `forward` | `sample` (the
forward of one step, then sampling with the masks computed meanwhile).

Regex constraints on the device (specjax.device_dfa): the static flag `dfa` (a row of the dispatch
has a device DFA) compiles in the masking by each row's DFA state and its advance, inside the
programs (several steps per dispatch, no host work per token); off, no mask work at all.

Grammar masks (`mask`) are token_mask.RowMasks: the bitmasks of the constrained rows only, with
their row indices (the row count bucketed: one executable per bucket); None without grammars.

Grammar rows may also pass `drafts` (prefill: [B, 1, S + 1], step / finish: [B, N, S + 1] int32):
the grammar's continuation after the prompt / after each node of the verified tree, which the
programs draft into the next tree (specjax.grammar_drafts). None (no grammar in the batch, or grammar
drafts off) compiles the programs without it.

Kernel choices (specjax.kernels.Kernels, made once at engine start) are closed over like the draft
and tree configuration: they are part of each program's static configuration. The fused step's static
`max_splits` caps the attention kernels' splits of a row's keys (specjax.attention.split_cap): the engine
passes a cap where every row of the dispatch is short, where fewer splits are faster.

Prefill programs take pieces (decode.PrefillRows: a cached prefix or earlier chunks before each
row's start). What an admission needs over its whole sequence (penalty state, n-gram history) is
written apart (`admit_slots`), since a piece may hold part of it only.

`compile_spec_steps` binds the bare step functions the same way (whole-prompt prefill, one fused step,
sampling arrays passed per call), for the tests of the step itself.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import attention as attn_lib, decode, lazy_draft, spec_tiers, step as step_lib, step_lite, step_prefill
from specjax import device_dfa as dfa_lib
from specjax.kernels import Kernels
from specjax.sampling import SamplingArrays

_STATIC = ("want_logprobs", "stochastic", "dfa")  # dfa: a row of the dispatch has a device DFA


def init_samp(max_slots: int) -> SamplingArrays:
    return SamplingArrays(temperature=jnp.zeros((max_slots,), jnp.float32), top_p=jnp.ones((max_slots,), jnp.float32),
                          top_k=jnp.zeros((max_slots,), jnp.int32), seed=jnp.zeros((max_slots,), jnp.uint32))


def _put_rows(samp_all: SamplingArrays, slots, samp: SamplingArrays) -> SamplingArrays:
    return jax.tree.map(lambda a, v: a.at[slots].set(v, mode="drop"), samp_all, samp)


def _take_rows(samp_all: SamplingArrays, slots) -> SamplingArrays:
    rs = jnp.minimum(slots, samp_all.seed.shape[0] - 1)
    return jax.tree.map(lambda a: a[rs], samp_all)


def _binder(params):
    leaves, treedef = jax.tree.flatten(params)
    return leaves, lambda w: jax.tree.unflatten(treedef, w)


def _admit_slots(state, tokens, lens, slots, pen):
    """The per-slot state of admissions over their whole sequences tokens [B, T] (lens [B]) that
    prefill pieces do not carry: the penalty state, the n-gram history (step_prefill.admit_slots)."""
    if isinstance(state, step_lib.SpecState):
        return step_prefill.admit_slots(state, tokens, lens, slots, pen)
    return dataclasses.replace(state, penalties=decode.prefill_penalties(state.penalties, tokens, lens, slots, pen))


admit_slots = jax.jit(_admit_slots, donate_argnums=(0,))  # (state, tokens, lens, slots, pen) -> state


def _admit_dfa(state, slots, cls, nxt, start):
    """The device DFA tables of admitted slots [B] (device_dfa.admit: cls [B, V], nxt [B, S, C],
    start [B] int32, -1 for a request without a DFA) -> state."""
    return dataclasses.replace(state, dfa=dfa_lib.admit(state.dfa, slots, cls, nxt, start))


admit_dfa = jax.jit(_admit_dfa, donate_argnums=(0,))  # (state, slots, cls, nxt, start) -> state


def _clear_dfa(state, slots):
    """Admitted slots [B] without a DFA: state -1 (a reused slot's DFA cleared) -> state."""
    tables = state.dfa
    return dataclasses.replace(state, dfa=dataclasses.replace(
        tables, state=tables.state.at[slots].set(-1, mode="drop")))


clear_dfa = jax.jit(_clear_dfa, donate_argnums=(0,))  # (state, slots) -> state


class PlainPrograms(NamedTuple):
    prefill: Callable  # (w, state, samp_all, rows: PrefillRows, samp, mask, *, want_logprobs, stochastic, dfa)
    #                    -> (StepOut, None, state, samp_all)
    decode_many: Callable  # (w, state, samp_all, slots, active, mask, *, num_steps, want_logprobs, stochastic,
    #                        dfa) -> (StepOut with [K, B] fields, None, state); a mask needs num_steps == 1
    forward: Callable  # (w, state, slots, active) -> (logits [B, V], state): decode_many(num_steps=1) = forward
    sample: Callable  # (state, logits, samp_all, slots, active, mask, *, want_logprobs, stochastic, dfa)
    #                   -> (StepOut with [1, B] fields, None, state)          ... then sample (grammar overlap)


def plain_programs(graphdef, params) -> tuple[PlainPrograms, list]:
    weights, unflat = _binder(params)

    def prefill(w, state, samp_all, rows, samp, mask, *, want_logprobs, stochastic, dfa=False):
        out, state = decode.prefill_rows(graphdef, unflat(w), state, rows, samp, want_logprobs=want_logprobs,
                                         stochastic=stochastic, token_mask=mask, dfa=dfa)
        return out, None, state, _put_rows(samp_all, rows.slots, samp)

    def decode_many(w, state, samp_all, slots, active, mask, *, num_steps, want_logprobs, stochastic, dfa=False):
        samp = _take_rows(samp_all, slots)
        if mask is None:
            out, state = decode.decode_many(graphdef, unflat(w), state, slots, active, samp, num_steps,
                                            want_logprobs=want_logprobs, stochastic=stochastic, dfa=dfa)
            return out, None, state
        assert num_steps == 1, "a grammar mask covers one decode step"
        out, state = decode.decode(graphdef, unflat(w), state, slots, active, samp, want_logprobs=want_logprobs,
                                   stochastic=stochastic, token_mask=mask, dfa=dfa)
        return jax.tree.map(lambda x: x[None], out), None, state

    def forward(w, state, slots, active):
        return decode.decode_forward(nnx.merge(graphdef, unflat(w)), state, slots, active)

    def sample(state, logits, samp_all, slots, active, mask, *, want_logprobs, stochastic, dfa=False):
        positions = state.cache.seq_lens[jnp.minimum(slots, state.cache.seq_lens.shape[0] - 1)]  # advanced: L + 1
        out, state = decode.decode_sample(state, logits, slots, active, _take_rows(samp_all, slots), positions,
                                          want_logprobs, stochastic, token_mask=mask, dfa=dfa)
        return jax.tree.map(lambda x: x[None], out), None, state

    return PlainPrograms(
        prefill=jax.jit(prefill, donate_argnums=(1, 2), static_argnames=_STATIC),
        decode_many=jax.jit(decode_many, donate_argnums=(1,), static_argnames=("num_steps",) + _STATIC),
        forward=jax.jit(forward, donate_argnums=(1,)),
        sample=jax.jit(sample, donate_argnums=(0,), static_argnames=_STATIC),
    ), weights


class StopRows(NamedTuple):
    """Per-row stop conditions that a multi-step dispatch checks on the device after every step, so
    a finished row stops changing state (it goes inactive for the remaining steps).
    ids: [B, E] int32 stop token ids (-1 pads); limit: [B] int32 the slot's sequence length at
    which the request is finished (len(prompt) + max_len - 1: its max_tokens or the context end)."""
    ids: jax.Array
    limit: jax.Array


class Successors(NamedTuple):
    """Row hand-over (SchedulerOptions.handover): each row's next request, prefilled ahead into a slot
    of its own. Inside a multi-step dispatch a row whose request has no live step left (finished by a
    step of this dispatch or before it: SpecState.done, its length limit) runs its successor's request
    for the remaining steps, once per dispatch, so the steps after a request's end are not lost and the
    host has no request boundary to launch. slots: [B] int32 (max_slots or more: none); stop: the
    successors' StopRows ([B, E] as the rows', [B])."""
    slots: jax.Array
    stop: StopRows


def no_stop(batch: int) -> StopRows:
    """Stop conditions that never stop a row (benchmarks, program tests)."""
    return StopRows(jnp.full((batch, 1), -1, jnp.int32), jnp.full((batch,), jnp.iinfo(jnp.int32).max, jnp.int32))


def _finished(out, seq_lens, stop: StopRows):
    """Rows finished by a step: a stop id among their out.num_accepted [B] emitted tokens
    out.tokens [B, S + 1], or their new length seq_lens [B] at the limit -> [B] bool."""
    emitted = jnp.arange(out.tokens.shape[1])[None, :] < out.num_accepted[:, None]  # [B, S + 1]
    hit = (out.tokens[:, :, None] == stop.ids[:, None, :]) & (stop.ids[:, None, :] >= 0)  # [B, S + 1, E]
    return jnp.any(hit.any(-1) & emitted, axis=1) | (seq_lens >= stop.limit)


def _stacked(out: step_lib.SpecOut) -> step_lib.SpecOut:
    """What a fused loop stacks per step (each stacked array is a kernel per step on a GPU): the tokens,
    with the slot each row ran as a last column (row hand-over); num_accepted and accept_hist are
    rebuilt from the tokens after the loop (`_unstacked`)."""
    toks = out.tokens if out.slot is None else jnp.concatenate([out.tokens, out.slot[:, None]], axis=1)
    return dataclasses.replace(out, tokens=toks, num_accepted=None, accept_hist=None, slot=None)


def _unstacked(outs: step_lib.SpecOut, slot: bool) -> step_lib.SpecOut:
    """_stacked's [K, B, ...] outputs -> the steps' own. A fused step emits num_accepted tokens (>= 0) in
    each active row, then -1, and only -1 in inactive rows (num_accepted 0): num_accepted is the count of
    tokens >= 0, and accept_hist [K, width + 1] counts the active rows by it."""
    toks, cur = (outs.tokens[..., :-1], outs.tokens[..., -1]) if slot else (outs.tokens, None)
    n = jnp.sum(toks >= 0, axis=-1, dtype=jnp.int32)  # [K, B]
    j = jnp.arange(toks.shape[-1] + 1, dtype=jnp.int32)
    hist = jnp.sum((n[..., None] == j) & (j > 0), axis=1, dtype=jnp.int32)  # [K, width + 1]
    return dataclasses.replace(outs, tokens=toks, num_accepted=n, accept_hist=hist, slot=cur)


class SpecPrograms(NamedTuple):
    prefill: Callable  # (tw, dw, state, samp_all, rows: PrefillRows, samp, mask, drafts=None, *, ...)
    #                    -> (out, trees, state, samp_all)
    step: Callable  # fused, K steps: (tw, dw, state, samp_all, slots, active, mask, stop: StopRows, drafts=None,
    #                 succ: Successors | None = None, *, num_steps, lite=False, lazy=False, ...)
    #                 -> (SpecOut with [K, B] fields, trees, state); with succ, out.slot [K, B] the slots run;
    #                 a mask or grammar drafts need K == 1; lite: K lite steps (step_lite.spec_lite_step), no mask;
    #                 lazy (with lite): K plain steps, the draft left behind (specjax.lazy_draft);
    #                 max_splits: attention splits at most (attention.split_cap: rows known to be short)
    verify: Callable  # (tw, state, slots, active) -> (logits, h, aux), state
    finish: Callable  # (tw, dw, state, verified, samp_all, slots, active, mask, drafts=None, *, ...)
    #                   -> (SpecOut with [1, B] fields, trees, state)


def _trees(state, slots):
    rs = jnp.minimum(slots, state.tree_tokens.shape[0] - 1)
    return state.tree_tokens[rs], state.tree_parents[rs]


def _tiered(fn, spec, num_nodes: int, arg: int, res: int):
    """fn with its state argument (position arg) narrowed to the tree shape `spec` and its state
    result (position res) widened back to the state's num_nodes tree columns (specjax.spec_tiers)."""
    def run(*args, **kw):
        full = args[arg]
        result = list(fn(*args[:arg], spec_tiers.narrow(full, spec, num_nodes), *args[arg + 1:], **kw))
        result[res] = spec_tiers.widen(full, result[res], spec, num_nodes)
        return tuple(result)
    return functools.wraps(fn)(run)


def spec_programs(info, spec, target_graphdef, target_params, draft_graphdef, draft_params,
                  kernels: Kernels = Kernels(), num_nodes: int | None = None):
    """-> (SpecPrograms, target weights, draft weights). kernels: the implementations to run. No draft
    model (the n-gram drafter): draft_graphdef and draft_params None, draft weights [].
    num_nodes: the state's tree columns when it holds several tiers' trees (specjax.spec_tiers; None:
    spec's own)."""
    tw0, tunflat = _binder(target_params)
    dw0, dunflat = _binder(draft_params)
    N = num_nodes or spec.num_nodes

    def tiered(fn, arg, res):
        return _tiered(fn, spec, N, arg, res)

    def bound(fn, tw, dw, *args, **kw):
        return fn(info, spec, target_graphdef, tunflat(tw), draft_graphdef, dunflat(dw), *args, **kw)

    def prefill(tw, dw, state, samp_all, rows, samp, mask, drafts=None, *, want_logprobs, stochastic, dfa=False):
        out, state = bound(step_prefill.spec_prefill_rows, tw, dw, state, rows, samp, want_logprobs=want_logprobs,
                           stochastic=stochastic, token_mask=mask, grammar_drafts=drafts, dfa=dfa, kernels=kernels)
        if state.done is not None:  # the slots' new requests have not finished
            state = dataclasses.replace(state, done=state.done.at[rows.slots].set(False, mode="drop"))
        return out, _trees(state, rows.slots), state, _put_rows(samp_all, rows.slots, samp)

    def fused(tw, dw, state, samp_all, slots, active, mask, stop, drafts=None, succ=None, *, num_steps,
              want_logprobs, stochastic, lite=False, lazy=False, dfa=False, max_splits=None):
        with attn_lib.splits_at_most(max_splits):  # attention kernels split rows' keys at most so (static)
            if succ is not None:
                assert not lite and mask is None and drafts is None, "row hand-over: fused steps, no grammar"
                return handover_steps(tw, dw, state, samp_all, slots, active, stop, succ, num_steps=num_steps,
                                      want_logprobs=want_logprobs, stochastic=stochastic, dfa=dfa)
            return fused_steps(tw, dw, state, samp_all, slots, active, mask, stop, drafts, num_steps=num_steps,
                               want_logprobs=want_logprobs, stochastic=stochastic, lite=lite, lazy=lazy, dfa=dfa)

    def handover_steps(tw, dw, state, samp_all, slots, active, stop, succ, *, num_steps, want_logprobs, stochastic,
                       dfa):
        """K fused steps whose rows hand over to their successors (Successors): each step runs the slots
        `cur` [B]; a row without a live request takes its successor (slot, stop conditions) while it has
        not yet; a step that finishes a row's request marks its slot done."""
        S = state.cache.seq_lens.shape[0]

        def live(state, act, cur, limit):  # [B] bool: act, and the slot's request not finished
            rs = jnp.minimum(cur, S - 1)
            return act & (cur < S) & (state.cache.seq_lens[rs] < limit) & ~state.done[rs]

        def turn(state, act, cur, stop, pend):  # the rows of the next step: act [B] of the step before
            act = live(state, act, cur, stop.limit)
            take = ~act & pend & live(state, pend, succ.slots, succ.stop.limit)
            cur = jnp.where(take, succ.slots, cur)
            stop = StopRows(jnp.where(take[:, None], succ.stop.ids, stop.ids), jnp.where(take, succ.stop.limit, stop.limit))
            return jnp.stack([act | take, cur, stop.limit, pend & ~take]).astype(jnp.int32), stop.ids

        def body(carry, _):  # ctl [4, B] int32: this step's act, cur, stop limit and pend, one carried array
            # computed at the end of the step before (each small carried array, and each value read again
            # after the state's update, cost a copy kernel per step on a GPU)
            state, ctl, ids = carry
            act, cur, stop, pend = ctl[0] > 0, ctl[1], StopRows(ids, ctl[2]), ctl[3] > 0
            out, state = bound(step_lib.spec_step, tw, dw, state, cur, act, _take_rows(samp_all, cur),
                               want_logprobs=want_logprobs, stochastic=stochastic, kernels=kernels, dfa=dfa)
            fin = act & _finished(out, state.cache.seq_lens[jnp.minimum(cur, S - 1)], stop)
            state = dataclasses.replace(state, done=state.done.at[cur].set(state.done[jnp.minimum(cur, S - 1)] | fin,
                                                                           mode="drop"))
            return (state, *turn(state, act & ~fin, cur, stop, pend)), _stacked(dataclasses.replace(out, slot=cur))

        ctl, ids = turn(state, active, slots, stop, succ.slots < S)
        (state, _, _), outs = jax.lax.scan(body, (state, ctl, ids), None, length=num_steps)
        outs = _unstacked(outs, slot=True)
        return outs, _trees(state, outs.slot[-1]), state

    def fused_steps(tw, dw, state, samp_all, slots, active, mask, stop, drafts, *, num_steps, want_logprobs,
                    stochastic, lite, lazy, dfa):
        samp = _take_rows(samp_all, slots)
        rs = jnp.minimum(slots, state.cache.seq_lens.shape[0] - 1)
        assert (mask is None and drafts is None) or (num_steps == 1 and not lite), \
            "grammar masks / drafts: one fused step"
        assert not lazy or (lite and lazy_draft.supports_lazy(info, spec)), "lazy: lite steps of an EAGLE head"

        def one(state, act):  # one fused (or lite) step; rows finished by it are inactive for the next ones
            if lite:
                out, state = bound(step_lite.spec_lite_step, tw, dw, state, slots, act, samp,
                                   want_logprobs=want_logprobs, stochastic=stochastic, kernels=kernels, dfa=dfa)
            else:
                out, state = bound(step_lib.spec_step, tw, dw, state, slots, act, samp, want_logprobs=want_logprobs,
                                   stochastic=stochastic, token_mask=mask, kernels=kernels, grammar_drafts=drafts,
                                   dfa=dfa)
            return out, state, act & ~_finished(out, state.cache.seq_lens[rs], stop)

        def live(state, act):  # a row dispatched again after its end (the host reads one step behind)
            return act & (state.cache.seq_lens[rs] < stop.limit)

        if lazy:  # plain decoding's program, the draft left behind (specjax.lazy_draft); rows past their
            # end at the dispatch's start stay put (the host reads one step behind)
            act = active & (state.cache.seq_lens[rs] < stop.limit)
            out, state = bound(lazy_draft.plain_steps, tw, dw, state, slots, act, samp, num_steps,
                               want_logprobs=want_logprobs, stochastic=stochastic, dfa=dfa)
            return out, _trees(state, slots), state

        # num_steps steps in a loop of static length: XLA on GPU reads a data-dependent loop
        # condition on the host every iteration (a sync that also breaks the command buffer), so the
        # loop does not end early; steps after every row finished run with no active row (their
        # num_accepted is 0, the state does not change)
        if num_steps == 1:
            out, state, _ = one(state, live(state, active))
            return jax.tree.map(lambda x: x[None], out), _trees(state, slots), state

        if lite:  # K lite steps of the target, then the draft extend over their K tokens at once
            def lite_body(carry, _):  # each output stacked here is a kernel per step: the fewest, packed
                state, act = carry
                act = live(state, act)
                out, state, (h, aux) = bound(step_lite.spec_lite_target, tw, dw, state, slots, act, samp,
                                             want_logprobs=want_logprobs, stochastic=stochastic, kernels=kernels,
                                             dfa=dfa)
                packed = None if aux is None else jnp.concatenate(aux, axis=-1)  # [B, 1, len(aux) * E]
                done = _finished(out, state.cache.seq_lens[rs], stop)
                return (state, act & ~done), (dataclasses.replace(out, num_accepted=None, accept_hist=None), h, packed)

            (state, _), (outs, h, packed) = jax.lax.scan(lite_body, (state, active), None, length=num_steps)
            # a lite step emits one token in each active row (>= 0) and -1 elsewhere: its count, rebuilt
            outs = dataclasses.replace(outs, num_accepted=(outs.tokens[..., 0] >= 0).astype(jnp.int32))
            aux = None if packed is None else tuple(jnp.split(packed, len(info.aux_layers), axis=-1))
            state = bound(step_lite.lite_draft_sync, tw, dw, state, slots, active, (outs, (h, aux)))
            return step_lite.widen_lite(outs, spec.num_steps + 1), _trees(state, slots), state

        def body(carry, _):  # act: this step's rows, found live at the end of the step before (a value read
            # again after the state's update costs a copy kernel per step on a GPU)
            state, act = carry
            out, state, act = one(state, act)
            return (state, live(state, act)), _stacked(out)

        (state, _), outs = jax.lax.scan(body, (state, live(state, active)), None, length=num_steps)
        return _unstacked(outs, slot=False), _trees(state, slots), state

    def verify(tw, state, slots, active):
        target = nnx.merge(target_graphdef, tunflat(tw))
        ver = step_lib.verify_forward(info, spec, target, state, slots, active)
        return (ver.logits, ver.h, ver.aux), dataclasses.replace(state, cache=ver.cache)

    def finish(tw, dw, state, verified, samp_all, slots, active, mask, drafts=None, *, want_logprobs, stochastic,
               dfa=False):
        target, draft = nnx.merge(target_graphdef, tunflat(tw)), step_lib.merge_draft(draft_graphdef, dunflat(dw))
        logits, h, aux = verified
        ver = step_lib.Verified(logits=logits, h=h, aux=aux, cache=state.cache)
        samp = _take_rows(samp_all, slots)
        acc = step_lib.accept(spec, state, ver, slots, active, samp, want_logprobs, stochastic, token_mask=mask,
                              kernels=kernels, dfa=dfa)
        new = step_lib.draft_next(info, spec, target, draft, state, ver, acc, slots, active, samp, stochastic,
                                  drafts, kernels)
        return jax.tree.map(lambda x: x[None], acc.out), _trees(new, slots), new

    jit = functools.partial(jax.jit, static_argnames=_STATIC)
    return SpecPrograms(prefill=jit(tiered(prefill, 2, 2), donate_argnums=(2, 3)),
                        step=jax.jit(tiered(fused, 2, 2), donate_argnums=(2,),
                                     static_argnames=("num_steps", "lite", "lazy", "max_splits") + _STATIC),
                        verify=jax.jit(tiered(verify, 1, 1), donate_argnums=(1,)),
                        finish=jit(tiered(finish, 2, 2), donate_argnums=(2,))), tw0, dw0


def num_compiled(programs) -> int:
    """Compiled executables held by a program tuple (for recompilation checks)."""
    return sum(fn._cache_size() for fn in programs if hasattr(fn, "_cache_size"))


class SpecSteps(NamedTuple):
    prefill: Callable  # (tw, dw, state, tokens [B, T], lens [B], slots [B], samp, *, want_logprobs, stochastic,
    #                     penalty_params, ...) -> (decode.StepOut, state)
    step: Callable  # (tw, dw, state, slots, active, samp, *, want_logprobs, stochastic, ...) -> (SpecOut, state)


def compile_spec_steps(info, spec, target_graphdef, target_params, draft_graphdef, draft_params,
                       kernels: Kernels = Kernels()):
    """The bare step functions as programs, for tests of the step itself: whole-prompt prefill
    (step_prefill.spec_prefill) and one fused step (step.spec_step) over rows given by the caller, with
    their sampling arrays as arguments (no per-slot sampling state, no stop rows: what spec_programs
    adds for the engine). -> (SpecSteps, target weights, draft weights); the state (argument 2) is
    donated."""
    tw0, tunflat = _binder(target_params)
    dw0, dunflat = _binder(draft_params)

    def bound(fn):
        def run(tw, dw, *args, **kw):
            return fn(info, spec, target_graphdef, tunflat(tw), draft_graphdef, dunflat(dw), *args, kernels=kernels,
                      **kw)
        return run

    jit = functools.partial(jax.jit, donate_argnums=(2,), static_argnames=("want_logprobs", "stochastic"))
    return SpecSteps(prefill=jit(bound(step_prefill.spec_prefill)), step=jit(bound(step_lib.spec_step))), tw0, dw0
