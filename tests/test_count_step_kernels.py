"""scripts/count_step_kernels.py counts the kernels of each program's step loop from compiled HLO."""
import jax
import jax.numpy as jnp
import pytest

from helpers import load_script


def test_plain_and_lite_steps_share_the_target_layers_and_differ_outside(tmp_path):
    mod = load_script("count_step_kernels")
    counts = mod.main(["--batch", "4", "--steps", "2", "--programs", "plain,lite", "--json", str(tmp_path / "k.json")])
    plain, lite = counts["plain"], counts["lite"]

    def layers(c):
        return {k: v for k, v in c.items() if k.startswith("layerN/")}
    assert layers(plain) and layers(plain) == layers(lite)  # one target forward per step in both
    assert sum(v for k, v in lite.items() if k.startswith("accept/")) > 0  # the lite step's acceptance
    assert not any(k.startswith(("accept/", "verify/", "draft/")) for k in plain)
    assert (tmp_path / "k.json").read_text().count("layerN/") == 2 * len(layers(plain))


def test_a_program_without_a_loop_is_refused():
    mod = load_script("count_step_kernels")
    hlo = jax.jit(lambda x: jnp.tanh(x) * 2).lower(jnp.ones(4)).compile().as_text()
    with pytest.raises(ValueError, match="no while loop"):
        mod.loop_kernels(hlo)
    with pytest.raises(SystemExit):
        mod.main(["--steps", "1"])


def test_tree_shape_and_draft_topk_reach_the_fused_program():
    mod = load_script("count_step_kernels")
    small = mod.main(["--batch", "1", "--steps", "2", "--programs", "fused"])["fused"]
    deep = mod.main(["--batch", "1", "--steps", "2", "--programs", "fused", "--tree", "5:3:12", "--ngram-branch", "3",
                     "--draft-topk", "reduce"])["fused"]

    def draft(c):
        return sum(v for k, v in c.items() if k.startswith("draft/"))
    assert draft(deep) > draft(small) > 0  # two more growth levels and the branch's lookup and merge
    with pytest.raises(SystemExit):
        mod.main(["--tree", "5:3"])


_LOOP_HLO = """HloModule m

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  %a = f32[4]{0} fusion(%x), kind=kLoop, calls=%f1, metadata={op_name="jit(fused)/while/body/closed_call/closed_call/verify/layer3/attn/pad"}
  %b = (f32[4]{0}, f32[4]{0}) custom-call(%a), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(fused)/while/body/closed_call/closed_call/verify/layer3/attn/mpmd_map"}
  %c = s32[2]{0} copy(%y)
  ROOT %t = (s32[], f32[4]) tuple(%i, %a)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %w = (s32[], f32[4]) while(%init), condition=%cond, body=%body
}
"""


def test_gpu_counts_take_custom_calls_and_fold_nested_calls_and_layers():
    """On a GPU a custom call (cuBLAS, a Mosaic kernel) is a kernel; on the CPU it is not counted. Op names
    lose every closed_call level and the verify scope of the target's layers."""
    mod = load_script("count_step_kernels")
    assert mod.loop_kernels(_LOOP_HLO) == {"layerN/attn/pad": 1, "(unnamed)": 1}
    assert mod.loop_kernels(_LOOP_HLO, gpu=True) == {"layerN/attn/pad": 1, "layerN/attn/mpmd_map": 1, "(unnamed)": 1}
    assert [n for _, n in mod.loop_body_kernels(_LOOP_HLO, gpu=True)] == [
        "verify/layer3/attn/pad", "verify/layer3/attn/mpmd_map", "(unnamed)"]


def test_a_gpu_target_compiles_for_a_compile_only_device_or_names_the_plugin_to_install():
    """--target h100: a device of that GPU that programs compile for without one, through jax's CUDA
    plugin; where the plugin is missing (this CI), the error names the pip command for this jax."""
    mod = load_script("count_step_kernels")
    try:
        dev = mod.compile_only_device("h100")
    except SystemExit as e:
        assert f"pip install jax-cuda12-plugin=={jax.__version__} jax-cuda12-pjrt=={jax.__version__}" in str(e)
        return
    assert dev.device_kind == "NVIDIA H100 80GB HBM3"
    hlo = jax.jit(lambda x: jnp.tanh(x) * 2).lower(
        jax.ShapeDtypeStruct((4,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(dev))).compile().as_text()
    assert "fusion" in hlo
