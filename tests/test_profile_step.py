"""scripts/profile_step.py's mapping of kernels to jax named scopes (the GPU run itself is in
docs/benchmarks.md): instruction names and op_name metadata read from XLA's optimized HLO text, and
scopes without jit / loop / layer-number noise."""
from __future__ import annotations

import os

from helpers import load_script


def _module():
    before = os.environ.get("XLA_FLAGS")
    mod = load_script("profile_step")
    assert os.environ.get("XLA_FLAGS") == before  # importing it changes nothing for other tests
    return mod


HLO = '''HloModule jit_fused, entry_computation_layout={()->()}

ENTRY %main {
  %fusion.12 = f32[4]{0} fusion(%p0), kind=kLoop, calls=%fc.12, metadata={op_name="jit(fused)/jit(main)/while/body/eval_jaxpr/verify/layer_3/attn/add" source_file="x.py"}
  ROOT gemm_fusion_dot.7 = bf16[2,8]{1,0} fusion(%a, %b), kind=kCustom, metadata={op_name="jit(fused)/jit(main)/draft/mlp/bte,ef->btf/dot_general"}
  %copy.3 = f32[4]{0} copy(%fusion.12)
}
'''


def test_scope_map_and_scope_of(tmp_path):
    mod = _module()
    (tmp_path / "module_0001.jit_fused.sm_9.0_gpu_after_optimizations.txt").write_text(HLO)
    (tmp_path / "module_0001.jit_fused.before_optimizations.txt").write_text(HLO.replace("fusion.12", "other.1"))
    smap = mod.scope_map(str(tmp_path))
    assert set(smap) == {("jit_fused", "fusion.12"), ("jit_fused", "gemm_fusion_dot.7")}  # after optimizations only
    assert mod.scope_of(smap[("jit_fused", "fusion.12")], 6) == "verify/layer*/attn"
    assert mod.scope_of(smap[("jit_fused", "gemm_fusion_dot.7")], 6) == "draft/mlp/bte,ef->btf"
    assert mod.scope_of(smap[("jit_fused", "fusion.12")], 1) == "verify"


def test_op_of_keeps_the_primitive_and_folds_layers():
    mod = _module()
    smap_op = "jit(fused)/jit(main)/while/body/eval_jaxpr/verify/layer_3/attn/add"
    assert mod.op_of(smap_op) == "verify/layer*/attn/add"
    assert mod.op_of("jit(fused)/draft/mlp/bte,ef->btf/dot_general") == "draft/mlp/bte,ef->btf/dot_general"
