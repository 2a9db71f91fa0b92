"""Tree shapes by the current batch: a speculative engine's tiers.

The best tree depends on the batch: one row affords a deep tree (the shipped head: 7 draft steps,
24 nodes + an n-gram branch of 7), 32 rows a small one (4 / 2 / 8), since verifying N nodes per row
costs compute that a large batch no longer has to spare. A draft's `spec_defaults` (specjax.checkpoint) measure the best
shape per batch size; an engine given several runs, for each decode dispatch, the shape of the
tier its rows fall in:

    tiers   ((min_rows, SpecConfig), ...), min_rows ascending from 1; all of one method; where
            one has an n-gram branch (SpecConfig.ngram_branch) the state keeps the token history
            and every tier appends to it (so large batches run lite steps, not lazy ones)
    pick    the tier of n rows padded to the program's rows bucket b (the rows a step computes:
            spec_defaults were measured on batches of exactly that many rows): the last whose
            min_rows <= b; a move to a smaller tier waits until n < 3/4 of the current tier's min_rows
            (a batch hovering at a boundary does not flap)
    state   the tree arrays ([max_slots, N] tokens / parents / depths, [max_slots, N, V] chain
            proposals) hold the largest N; a tier's programs read and write the first N_t columns
            (`narrow` at a program's entry, `widen` at its exit); the columns past N_t are stale
    switch  a row's tree was grown by the tier current at its admission or last switch
            (Engine._tree_tier); before a dispatch that reads the draft with another tier, the
            engine grows the row a new tree with the new tier's prefill: a piece over its last
            prompt-or-output token x_{L-1} (or from the draft's length Ld where it lags behind,
            specjax.engine_catchup) with the next token x_L, `PrefillRows.regrow`: the target's K/V
            entry L - 1 and the draft's entries are written again (equal to float32 rounding) and
            the tree is grown from x_L as at admission. Verification is lossless for any tree, so
            outputs do not change (tests). Host grammars freeze the tier while one is in a slot
            (their masks cover the trees the host read).

Opt-in (LLM(spec_tiers=True), --spec-tiers). Measured on an H200 with the shipped head
(docs/benchmarks.md, session 30): one request at a time in 32 slots ran 7/4/28 at the speed of
4/2/8 (τ 4.09 vs 3.32, a step 25 % dearer); closed batches of 8 ran 4 % slower than one tree (11-13 %
when the tier followed the rows, not their padded bucket: the 1-row tree over 8 padded rows), each
switch costing a read of the dispatches in flight and a prefill call.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from specjax.tree import SpecConfig, shape_label


class SpecTiers(NamedTuple):
    bounds: tuple[int, ...]  # min rows of each tier, ascending, bounds[0] == 1
    specs: tuple[SpecConfig, ...]

    @staticmethod
    def of(pairs) -> "SpecTiers":
        """pairs: [(min_rows, SpecConfig)] in any order -> SpecTiers (ValueError on a bad table)."""
        pairs = sorted(pairs, key=lambda p: p[0])
        if not pairs or pairs[0][0] != 1:
            raise ValueError(f"spec tiers must start at 1 row, got bounds {[b for b, _ in pairs]}")
        if len({b for b, _ in pairs}) != len(pairs):
            raise ValueError(f"spec tiers: repeated bounds {[b for b, _ in pairs]}")
        specs = [s for _, s in pairs]
        if len({s.method for s in specs}) > 1:
            raise ValueError(f"spec tiers must share method, got {[s.method for s in specs]}")
        return SpecTiers(tuple(b for b, _ in pairs), tuple(specs))

    @property
    def num_nodes(self) -> int:
        return max(s.num_nodes for s in self.specs)

    def pick(self, n_rows: int, current: int, padded: int | None = None) -> int:
        """The tier index for a dispatch of n_rows rows padded to `padded` (the program's rows bucket;
        None: n_rows), the current tier being `current` (module doc)."""
        want = max(i for i, b in enumerate(self.bounds) if b <= max(padded or n_rows, 1))
        if want < current and 4 * n_rows >= 3 * self.bounds[current]:
            return current
        return want


def describe(tiers: SpecTiers) -> str:
    """'>= 1 rows 7/4/24+7, >= 8 rows 5/4/16, ...' (num_steps / topk / num_draft_tokens [+ ngram_branch])."""
    return ", ".join(f">= {b} rows {shape_label(s.num_steps, s.topk, s.num_draft_tokens, s.ngram_branch)}"
                     for b, s in zip(tiers.bounds, tiers.specs))


def narrow(state, spec: SpecConfig, num_nodes: int):
    """The state a program of tree shape `spec` sees: the first spec.num_nodes tree columns (chain
    proposals only for a chain). num_nodes: the state's N; equal: the state itself."""
    N = spec.num_nodes
    if N == num_nodes and (spec.is_chain or state.draft_probs is None):
        return state
    probs = state.draft_probs[:, :N] if spec.is_chain and state.draft_probs is not None else None
    return dataclasses.replace(state, tree=state.tree[:, :, :N], draft_probs=probs)


def widen(full, new, spec: SpecConfig, num_nodes: int):
    """The full state after a program of tree shape `spec` that ran on narrow(full): new's tree
    columns written over the first N of full's (their other fields are new's)."""
    if new.tree_tokens.shape[1] == num_nodes and (new.draft_probs is not None or full.draft_probs is None):
        return new
    N = spec.num_nodes

    def put(a, b, axis=1):
        return jax.lax.dynamic_update_slice_in_dim(a, b, 0, axis=axis)
    probs = full.draft_probs if new.draft_probs is None else put(full.draft_probs, new.draft_probs)
    assert new.tree_tokens.shape[1] == N, (new.tree_tokens.shape, N)
    return dataclasses.replace(new, tree=put(full.tree, new.tree, axis=2), draft_probs=probs)
