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


def test_fused_call_probe_reads_loops_and_launches_from_optimized_hlo():
    """scripts/probe_fused_call.py's HLO summary: the while loops of a compiled module and the kernels of its
    entry and loop bodies (fusions, custom calls, copies)."""
    import jax
    from jax import lax

    mod = load_script("probe_fused_call")
    text = """HloModule m

%body.1 (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %a = f32[4]{0} fusion(%x), kind=kLoop, calls=%f1
  %b = f32[4]{0} custom-call(%a), custom_call_target="mosaic_gpu_v2"
  ROOT %t = (s32[], f32[4]) tuple(%i, %b)
}

ENTRY %main.2 (x: f32[4]) -> f32[4] {
  %c = f32[4]{0} copy(%x)
  %w = (s32[], f32[4]) while(%init), condition=%cond.1, body=%body.1
  ROOT %r = f32[4]{0} fusion(%w), kind=kLoop, calls=%f2
}
"""
    assert mod.hlo_summary(text) == {"while_loops": 1, "entry_kernels": 2, "body_kernels": [2]}

    def looped(x):
        return lax.fori_loop(0, 4, lambda i, y: jnp.tanh(y * 2.0 + i), x)

    compiled = jax.jit(looped).lower(jnp.ones(8)).compile().as_text()
    s = mod.hlo_summary(compiled)
    assert s["while_loops"] >= 1 and all(k >= 1 for k in s["body_kernels"])
    assert mod.hlo_summary(jax.jit(lambda x: jnp.tanh(x) * 2).lower(jnp.ones(8)).compile().as_text())["while_loops"] == 0
