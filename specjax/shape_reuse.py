"""Padded shapes that reuse programs already compiled, instead of compiling new ones.

The engine pads a prefill to (rows B, length T) and a decode dispatch to B rows, each a power-of-two
bucket (specjax.scheduler.bucket). A workload whose requests arrive and finish at different times
(offline generation with refilled slots, a server) meets many (B, T) pairs: one program each, and on
a GPU each costs seconds to compile for the 135M model (measured: data generation at batch 512 spent
most of its time compiling prefill and tail-decode programs). A padded dispatch costs the padding's
compute (rows out of range: slot max_batch, reads clamp, writes drop), milliseconds at most.

`ShapeReuse.pick(key, dims)` returns dims, or an already-used shape of the same key that is at least
as large in every dimension, whose size (the product of the dims) is at most `slack` times the size
asked for and at most `limit` -- the smallest such one. Whatever it returns is remembered as used.
The key holds everything else that selects a program (its static flags), so only shapes of the same
program family are reused. A second identical workload therefore compiles nothing either way; a
workload of varied shapes compiles a few programs and then reuses them. `need` (default: the size
of dims) replaces the size that the slack multiplies, for a caller whose dims are smaller than the
work it would accept: a prefill of prompts found whole in the prefix cache (specjax.engine) may
take any shape their uncached prefill could have taken.

    reuse = ShapeReuse(slack=4)
    reuse.pick(("prefill", flags), (16, 256))   -> (16, 256)   first use: compiled
    reuse.pick(("prefill", flags), (8, 256))    -> (16, 256)   2x the size: reused
    reuse.pick(("prefill", flags), (1, 32))     -> (1, 32)     (16, 256) would be 128x: compiled
    reuse.pick(("prefill", flags), (1, 64), need=1024)  -> (16, 256)  4x the need: reused
"""
from __future__ import annotations

import math
from collections.abc import Hashable

__all__ = ["ShapeReuse"]


class ShapeReuse:
    def __init__(self, slack: float = 4.0):
        if not slack >= 1.0:
            raise ValueError(f"slack must be >= 1, got {slack!r}")
        self.slack = slack
        self.used: dict[Hashable, set[tuple[int, ...]]] = {}
        self.reused = 0  # picks answered with a larger shape already used

    def pick(self, key: Hashable, dims: tuple[int, ...], limit: int | None = None,
             need: int | None = None) -> tuple[int, ...]:
        """dims (each >= 1), or the smallest already-used shape of `key` that covers them within
        slack x their size, or x need when that is larger (and <= limit, when given)."""
        dims = tuple(int(d) for d in dims)
        found = self.find(key, dims, limit, need)
        if found is None:
            self.add(key, dims)
            return dims
        if found != dims:
            self.reused += 1
        return found

    def find(self, key: Hashable, dims: tuple[int, ...], limit: int | None = None,
             need: int | None = None) -> tuple[int, ...] | None:
        """What pick would return from the shapes already used (dims itself if used), without
        remembering anything; None: pick would add dims (a program not compiled yet)."""
        dims = tuple(int(d) for d in dims)
        seen = self.used.get(key, ())
        if dims in seen:
            return dims
        size = max(math.prod(dims), need or 0)
        cap = self.slack * size if limit is None else min(self.slack * size, limit)
        fits = [s for s in seen if len(s) == len(dims) and all(a >= b for a, b in zip(s, dims))
                and math.prod(s) <= cap]
        return min(fits, key=lambda s: (math.prod(s), s)) if fits else None

    def add(self, key: Hashable, dims: tuple[int, ...]) -> None:
        """Remember dims as used (e.g. a program compiled ahead of its first dispatch)."""
        self.used.setdefault(key, set()).add(tuple(int(d) for d in dims))
