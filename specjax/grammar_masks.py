"""The grammar masks of one engine step, for the constrained rows only, built in parallel on the host.

Data flow (specjax.engine calls this while the step's target forward runs on the device):

    constrained rows [(batch row b, RequestGrammar g[, next tree (tokens [N], parents [N])])]   R of B
      -> HostMasks: bits [Rp, W] (the next token)  or  [Rp, N, W] (the token after each tree node),
                    rows [Rp] int32 (b; padding and failed rows: B, a no-op on the device),
                    failures [(i, reason)] (rows whose grammar raised: the engine fails their requests)
      -> the engine uploads RowMasks(bits, rows) (specjax.token_mask), which the device applies to
         those rows only. Rp = token_mask.rows_bucket(R, B): few shapes, few compiled programs.

Parallelism (xgrammar's calls release the GIL), from PARALLEL_ROWS live rows on (fewer: on the
calling thread, where a thread handoff would cost more than the masks):
  * next-token masks: one xgrammar BatchGrammarMatcher.batch_fill_next_token_bitmask call over all
    live rows, on its own C++ threads (`threads`); rows of terminated grammars get their stop mask.
  * tree masks: the tree bookkeeping (checks, stop nodes, first-child / sibling links, reachability
    and stop rows afterwards) is vectorised over the rows in numpy (specjax.grammar); the per-row
    traversals (xgrammar's C++ traverse_draft_tree) run in chunks on a persistent thread pool.
A grammar that raises (a broken matcher, a vocabulary that does not match the model's) fails its
own row: when the batched fill raises, the rows are filled one by one to find the culprits.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from specjax.grammar import bad_trees, settle_tree_masks, stop_nodes, tree_links
from specjax.token_mask import rows_bucket

__all__ = ["HostMasks", "MaskBuilder", "default_threads"]

PARALLEL_ROWS = 8  # fewer live rows are filled on the calling thread (a thread handoff costs more than a mask)


def default_threads() -> int:
    """Mask threads when not given: half the CPU cores (the other half runs the engine and JAX), 1..8."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


@dataclasses.dataclass
class HostMasks:
    bits: np.ndarray  # [Rp, W] or [Rp, N, W] int32
    rows: np.ndarray  # [Rp] int32 batch row of each mask; B: padding or a failed row
    failures: list[tuple[int, str]]  # (index into the entries, why its grammar failed)


def _reason(e: Exception) -> str:
    return f"grammar error during generation: {type(e).__name__}: {e}"


@functools.lru_cache(maxsize=None)
def _pool(threads: int) -> ThreadPoolExecutor:
    """One persistent pool per thread count, shared by the engines of a process."""
    return ThreadPoolExecutor(threads, thread_name_prefix="specjax-masks")


@functools.lru_cache(maxsize=None)
def _batch_matcher(threads: int):
    import xgrammar as xg
    return xg.BatchGrammarMatcher(threads)


class MaskBuilder:
    """Builds a step's masks of the constrained rows of a batch (vocabulary of `width` words per row)."""

    def __init__(self, width: int, threads: int | None = None):
        self.width = width
        self.threads = threads or default_threads()

    def _start(self, grammars, batch: int, shape: tuple[int, ...], fill, pad: int | None = None
               ) -> tuple[HostMasks, list[int]]:
        """The output buffers (padding rows: index B) and the rows whose grammar has the model's width."""
        R = len(grammars)
        rp = rows_bucket(R, batch) if pad is None else max(pad, R)
        bits = fill((rp,) + shape + (self.width,), np.int32)  # fresh: the device may alias host memory
        rows = np.full(rp, batch, np.int32)
        out = HostMasks(bits, rows, [])
        ok = []
        for i, g in enumerate(grammars):
            if g.width != self.width:
                out.failures.append((i, f"the grammar's vocabulary ({g.vocab_size} tokens) does not match the "
                                        f"model's ({self.width} mask words)"))
            else:
                ok.append(i)
        return out, ok

    def _finish(self, out: HostMasks, batch_rows) -> HostMasks | None:
        failed = {i for i, _ in out.failures}
        for i, b in enumerate(batch_rows):
            if i not in failed:
                out.rows[i] = b
        return out

    # -- plain decoding and prefill: the next token ------------------------------------------------
    def next_masks(self, entries: list[tuple[int, object]], batch: int, pad: int | None = None) -> HostMasks | None:
        """entries: (batch row, RequestGrammar) of the constrained rows of a batch of `batch` rows.
        -> bits [Rp, W] (None when no entry); pad: Rp (default: rows_bucket(len(entries), batch))."""
        if not entries:
            return None
        grammars = [g for _, g in entries]
        out, ok = self._start(grammars, batch, (), np.empty, pad)
        out.bits[len(entries):] = -1
        live = []
        for i in ok:
            try:
                if grammars[i].is_terminated:
                    out.bits[i] = grammars[i].stop_mask
                else:
                    live.append(i)
            except Exception as e:  # noqa: BLE001 - a broken matcher fails its own request
                out.failures.append((i, _reason(e)))
        if live:
            self._fill(grammars, live, out)
        return self._finish(out, [b for b, _ in entries])

    def _fill(self, grammars, live: list[int], out: HostMasks) -> None:
        try:
            threads = self.threads if len(live) >= PARALLEL_ROWS else 1  # a few rows: threads cost more than they save
            _batch_matcher(threads).batch_fill_next_token_bitmask([grammars[i]._matcher for i in live], out.bits, live)
            return
        except Exception:  # noqa: BLE001 - find the row(s) that raise, fill the others
            pass
        for i in live:
            try:
                grammars[i].next_mask(out.bits[i])
            except Exception as e:  # noqa: BLE001
                out.failures.append((i, _reason(e)))

    # -- speculative decoding: every node of the next draft tree -----------------------------------
    def tree_masks(self, entries: list[tuple[int, object, tuple]], batch: int) -> HostMasks | None:
        """entries: (batch row, RequestGrammar, (tokens [N], parents [N])) of the constrained rows.
        -> bits [Rp, N, W]: row i of node j allows the tokens after the path root..j (all zero below
        an illegal node; stop tokens only after a stop node); None when no entry."""
        if not entries:
            return None
        grammars = [g for _, g, _ in entries]
        tokens = np.stack([np.asarray(t[0]) for _, _, t in entries]).astype(np.int64)  # [R, N]
        parents = np.stack([np.asarray(t[1]) for _, _, t in entries]).astype(np.int64)
        R, N = tokens.shape
        out, ok = self._start(grammars, batch, (N,), np.zeros)
        out.bits[R:] = -1
        bad = bad_trees(tokens, parents, self.width * 32)
        for i in np.flatnonzero(bad):
            out.failures.append((int(i), f"not a draft tree: parents {parents[i].tolist()}, tokens {tokens[i].tolist()}"))
        if bad.any():  # keep the vectorised steps in range; these rows are failures already
            parents[bad] = np.concatenate([[-1], np.zeros(N - 1, np.int64)])
            tokens[bad] = 0
        stop = stop_nodes(grammars, tokens)
        first, sibling = tree_links(parents, stop)
        terminated = np.zeros(R, bool)
        live = []
        for i in ok:
            if bad[i]:
                continue
            try:
                terminated[i] = grammars[i].is_terminated
            except Exception as e:  # noqa: BLE001
                out.failures.append((i, _reason(e)))
                continue
            if not terminated[i]:
                live.append(i)

        def walk(part):
            failed = []
            for i in part:
                try:
                    grammars[i].traverse(first[i], sibling[i], tokens[i], stop[i], out.bits[i])
                except Exception as e:  # noqa: BLE001
                    failed.append((i, _reason(e)))
            return failed

        parts = self._parts(live)
        if len(parts) > 1:
            for failed in _pool(self.threads).map(walk, parts):
                out.failures.extend(failed)
        else:
            out.failures.extend(walk(live))
        stop_masks = np.stack([g.stop_mask if g.width == self.width else np.zeros(self.width, np.int32)
                               for g in grammars])
        settle_tree_masks(tokens, parents, stop, terminated, stop_masks, out.bits[:R])
        return self._finish(out, [b for b, _, _ in entries])

    def _parts(self, live: list[int]) -> list[list[int]]:
        """The live rows in chunks of >= PARALLEL_ROWS / 2 for the pool (one chunk: run inline)."""
        if self.threads < 2 or len(live) < PARALLEL_ROWS:
            return [live]
        k = min(self.threads, len(live) // (PARALLEL_ROWS // 2))
        return [live[j::k] for j in range(k)]
