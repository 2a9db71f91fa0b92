"""scripts/probe_dispatch_cost.py runs on the CPU and times every program it names."""
import json
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


def test_engine_timeline_probe_records_every_step_of_the_timed_call(tmp_path):
    """scripts/probe_engine_timeline.py on a tiny model: one row per Engine.step() of the second generate call,
    whose prefills and finished requests add up to the prompts, and totals that split the steps' time; with
    --handover the same tokens."""
    from tiny_dir import make_tiny_model_dir

    mod = load_script("probe_engine_timeline")
    d = make_tiny_model_dir(tmp_path / "m")
    res = mod.main(["--model", str(d), "--draft", "ngram", "--prompts", "3", "--max-tokens", "12",
                    "--dtype", "float32", "--show", "5"])
    allr = res["all"]
    assert allr["prefills"] == 3 and allr["decode_dispatches"] > 0 and res["finished"] == 3 and res["steps"] == allr["steps"]
    assert res["boundary"]["steps"] + res["inner"]["steps"] == res["steps"] and res["boundary"]["prefills"] == 3
    assert 0 < allr["step_s"] <= res["wall_s"] and allr["read_wait_s"] + allr["dispatch_s"] <= allr["step_s"]
    assert abs(allr["step_s"] + allr["between_steps_s"] - res["wall_s"]) < 1e-3
    assert len(res["repeat_wall_s"]) == 1 and res["repeat_wall_s"][0] >= res["wall_s"] and len(res["tokens_sha1"]) == 12
    hand = mod.main(["--model", str(d), "--draft", "ngram", "--prompts", "3", "--max-tokens", "12",
                     "--dtype", "float32", "--show", "0", "--handover"])  # row hand-over: the same greedy tokens
    assert hand["tokens_sha1"] == res["tokens_sha1"] and hand["finished"] == 3


def test_engine_timeline_device_gaps_merge_overlaps_and_sum_gaps_by_programs():
    mod = load_script("probe_engine_timeline")
    us = 1000
    iv = [(0, 100 * us, "jit_fused"), (50 * us, 120 * us, "jit_fused"),  # overlapping: one busy stretch
          (130 * us, 200 * us, "jit_fused"),  # 10 us gap: under the 20 us floor
          (500 * us, 600 * us, "jit_prefill"),  # 300 us gap fused -> prefill
          (650 * us, 700 * us, "jit_fused")]  # 50 us gap prefill -> fused
    d = mod.device_gaps(iv)
    assert d["kernels"] == 5 and d["span_ms"] == 0.7 and d["busy_ms"] == 0.34 and d["idle_ms"] == 0.36
    assert d["idle_ms_in_gaps_over_20us"] == 0.35
    assert d["gaps_over_20us_by_programs"] == {"jit_fused -> jit_prefill": {"n": 1, "ms": 0.3},
                                               "jit_prefill -> jit_fused": {"n": 1, "ms": 0.05}}



def test_boundary_modes_probe_times_every_mode_in_rounds(tmp_path):
    """scripts/probe_boundary_modes.py on a tiny model: every mode timed once a round, the speculative modes'
    tau, ratio to plain and bar; float32 greedy tokens equal across the modes."""
    from tiny_dir import make_tiny_model_dir

    mod = load_script("probe_boundary_modes")
    d = make_tiny_model_dir(tmp_path / "m")
    res = mod.main(["--model", str(d), "--draft", "ngram", "--prompts", "3", "--max-tokens", "12",
                    "--dtype", "float32", "--rounds", "2", "--json", str(tmp_path / "r.json")])
    modes = res["modes"]
    assert set(modes) == set(mod.MODES) and all(len(m["walls"]) == 2 for m in modes.values())
    assert len({m["tokens_sha1"] for m in modes.values()}) == 1 and modes["plain"]["tokens"] == 36
    for name, m in modes.items():
        assert m["tok_s"] > 0 and m["wall_s"] == sum(m["walls"]) / 2  # the median of two
        if name != "plain":
            assert m["tau"] >= 1 and m["spec_dispatch_steps"] > 0
            assert m["bar"] == round(m["tau"] / 1.3, 3)
            assert m["x_plain"] == round(m["tok_s"] / modes["plain"]["tok_s"], 3)
    assert json.loads((tmp_path / "r.json").read_text())["modes"].keys() == modes.keys()
