"""Small per-dispatch host arrays (rows' slots, active flags, stop conditions, successors) passed to the
engine's programs as device arrays kept by content: equal values reach a program in the same device
buffers on every call instead of fresh ones. On an H200 a fresh argument buffer makes XLA update the
program's CUDA graphs (command buffers) on the host: a batch-1 fused dispatch cost 2.57 ms of host time
with fresh arguments and 1.95 ms with kept ones (docs/benchmarks.md, session 40). At batch 1 the values
are equal for all of a request's dispatches. Not used with a mesh (the arrays would need its shardings)."""
from __future__ import annotations

from collections import OrderedDict

import jax
import numpy as np


class ArgCache:
    """LRU of device arrays by (shape, dtype, bytes) of small numpy arrays."""
    MAX_ELEMENTS = 1 << 14  # larger arrays (grammar masks) pass through as they are

    def __init__(self, size: int = 64):
        self.size = size
        self._kept: OrderedDict[tuple, jax.Array] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, x):
        """x as a kept device array (a small numpy array), else x itself."""
        if not isinstance(x, np.ndarray) or x.size > self.MAX_ELEMENTS:
            return x
        key = (x.shape, x.dtype.str, x.tobytes())
        dev = self._kept.get(key)
        if dev is None:
            self.misses += 1
            dev = self._kept[key] = jax.device_put(x)
            if len(self._kept) > self.size:
                self._kept.popitem(last=False)
        else:
            self.hits += 1
            self._kept.move_to_end(key)
        return dev

    def tree(self, t):
        """Every small numpy leaf of t kept (NamedTuples of arrays: StopRows, Successors)."""
        return jax.tree.map(self.get, t)
