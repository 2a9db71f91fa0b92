"""scripts/probe_layer_fusion.py runs on the CPU: its formulations of a layer compute one function."""
from helpers import load_script


def test_layer_formulations_agree_and_are_counted():
    rows = load_script("probe_layer_fusion").main(["--rows", "2", "--layers", "2", "--reps", "1"])
    assert [r["variant"] for r in rows] == ["base", "post", "post_g", "silu32"]
    assert rows[0]["f32_max_diff"] == 0.0
    assert all(r["f32_max_diff"] < 1e-4 for r in rows)  # the same function, rounded differently
    assert all(r["kernels_per_layer"] > 0 and r["us_per_layer"] > 0 and r["wall_us_per_layer"] > 0 for r in rows)
