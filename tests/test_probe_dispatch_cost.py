"""scripts/probe_dispatch_cost.py runs on the CPU and times every program it names."""
import math

import jax.numpy as jnp
import numpy as np

from helpers import load_script


def _load():
    return load_script("probe_dispatch_cost")


def test_probe_times_each_program_and_the_chains_compute_the_same():
    mod = _load()
    res = mod.main(["--args", "1,3", "--links", "4,8", "--reps", "3"])
    assert set(res) == {"args 1", "args 3", "donate 290 / 1", "donate 290 / 45", "donate 1 / 45",
                        "kernels 4", "scan4 4", "kernels 8", "scan4 8"}
    assert all(math.isfinite(v) and v > 0 for v in res.values())
    # the scanned chain is the unrolled chain regrouped: 4 iterations of links / 4 (offsets 0 .. links/4 - 1)
    x, w = jnp.ones((16, 64), jnp.float32) * 0.1, jnp.full((64, 64), 0.01, jnp.float32)
    ref = x
    for _ in range(4):
        for i in range(2):
            ref = jnp.tanh(ref @ w + i)
    np.testing.assert_allclose(np.asarray(mod.scanned_chain(8)(x, w)), np.asarray(ref), rtol=1e-5, atol=1e-6)
