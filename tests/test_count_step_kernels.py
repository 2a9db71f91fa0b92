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
