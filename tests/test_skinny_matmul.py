"""The skinny-M Mosaic GPU matmul (pallas_kernels/skinny_matmul.py) in the Mosaic GPU interpreter against
its jnp reference: several weights in one launch, uneven K splits, more stages than K blocks, 1 to 64
rows; its lowering for CUDA (no GPU); the shapes it refuses. Its speed against XLA's dots is measured
by scripts/bench_skinny_gemm.py on the GPU (docs/benchmarks.md): it is not dispatched by the models."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels.mosaic_gpu import interpreter_available
from pallas_kernels.skinny_matmul import auto_tiles, skinny_matmul, skinny_matmul_reference, why_not_skinny


def _case(seed, M, K, Ns):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    ws = tuple(jnp.asarray(rng.standard_normal((K, n)) * 0.1, jnp.bfloat16) for n in Ns)
    return x, ws


@pytest.mark.skipif(not interpreter_available(), reason="no Mosaic GPU interpreter in this jax")
@pytest.mark.parametrize("M,K,Ns,tn,splits,stages", [
    (17, 256, (128, 64), 64, 3, 2),  # q/k-like pair in one launch; 4 K blocks in 3 uneven splits
    (1, 128, (128,), None, None, 4),  # one row; auto tiles; more stages than K blocks
    (64, 192, (128, 256), 128, 1, 4),  # the most rows; 128-column tiles
    (5, 320, (64,), 64, 2, 3),  # rows not a multiple of 8 (padded to 8 for the TMA)
])
def test_interpreted_matches_reference(M, K, Ns, tn, splits, stages):
    x, ws = _case(M * 7 + K, M, K, Ns)
    got = skinny_matmul(x, ws, tn=tn, splits=splits, stages=stages, out_dtype=jnp.float32, interpret=True)
    want = skinny_matmul_reference(x, ws, jnp.float32)
    assert [g.shape for g in got] == [(M, n) for n in Ns]
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)
    got16 = skinny_matmul(x, ws, tn=tn, splits=splits, stages=stages, interpret=True)
    assert all(g.dtype == jnp.bfloat16 for g in got16)


def test_lowers_for_cuda():
    """TMA tile copies into swizzled SMEM, wgmma into an accumulator across the K loop, the per-weight
    branches; compiling to a cubin and running need a GPU."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    x = jax.ShapeDtypeStruct((17, 4096), jnp.bfloat16)
    ws = (jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16))
    text = export.export(jax.jit(lambda x, ws: skinny_matmul(x, ws)), platforms=("cuda",))(x, ws).mlir_module()
    assert "mosaic_gpu" in text


def test_auto_tiles_give_about_one_cta_per_sm():
    assert auto_tiles(4096, [14336, 14336]) == (128, 1)  # 224 column tiles: enough without splits
    assert auto_tiles(14336, [4096]) == (128, 4)  # 32 tiles x 4 splits = 128 CTAs for 132 SMs
    assert auto_tiles(4096, [4096, 1024, 1024]) == (128, 3)  # 48 tiles
    assert auto_tiles(4096, [4096, 192])[0] == 64  # a width that 128 does not divide
    assert auto_tiles(256, [128]) == (128, 1)  # 4 K blocks: no room for a split


@pytest.mark.parametrize("dtype,M,K,Ns,needle", [
    (jnp.float32, 17, 256, (128,), "bf16 / f16"),
    (jnp.bfloat16, 65, 256, (128,), "65 rows"),
    (jnp.bfloat16, 17, 200, (128,), "K = 200"),
    (jnp.bfloat16, 17, 256, (100,), "[100]"),
])
def test_refuses_what_it_cannot_serve(dtype, M, K, Ns, needle):
    assert needle in why_not_skinny(dtype, M, K, Ns)
    x = jnp.zeros((M, K), dtype)
    with pytest.raises(ValueError, match="skinny_matmul"):
        skinny_matmul(x, tuple(jnp.zeros((K, n), dtype) for n in Ns), interpret=True)
    assert why_not_skinny(jnp.bfloat16, 17, 256, (128, 64)) is None


def test_refuses_bad_tiles_and_mismatched_weights():
    x, ws = _case(0, 8, 128, (128,))
    with pytest.raises(ValueError, match="tn 96"):
        skinny_matmul(x, ws, tn=96, interpret=True)
    with pytest.raises(ValueError, match="splits 3"):
        skinny_matmul(x, ws, splits=3, interpret=True)  # 2 K blocks
    with pytest.raises(ValueError, match="do not all take x"):
        skinny_matmul(x, (jnp.zeros((64, 128), jnp.bfloat16),), interpret=True)


def test_benchmark_script_times_xla_and_quantized_weights(capsys, monkeypatch):
    """scripts/bench_skinny_gemm.py on the CPU (the kernel itself needs a GPU): one JSON line per group and
    row count, with int8 / fp8 weights within their rounding of the bf16 product."""
    import json
    import sys
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_skinny_gemm
    monkeypatch.setattr(sys, "argv", ["bench_skinny_gemm.py", "--shape", "tiny", "--rows", "2,17", "--groups",
                                      "qkv,down", "--steps", "1", "--budget-mb", "1", "--quant", "int8,fp8",
                                      "--no-kernel"])
    bench_skinny_gemm.main()
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["group"], r["M"]) for r in rows] == [("qkv", 2), ("qkv", 17), ("down", 2), ("down", 17)]
    for r in rows:
        assert r["xla_us"] > 0 and r["xla_int8_us"] > 0 and r["xla_fp8_us"] > 0
        assert 0 < r["int8_rel_err"] < 0.02 and 0 < r["fp8_rel_err"] < 0.06


@pytest.mark.parametrize("flag,value", [("--quant", "int4"), ("--groups", "qkv,attn")])
def test_benchmark_script_refuses_unknown_names(flag, value, monkeypatch):
    import sys
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_skinny_gemm
    monkeypatch.setattr(sys, "argv", ["bench_skinny_gemm.py", "--shape", "tiny", "--no-kernel", flag, value])
    with pytest.raises(SystemExit) as e:
        bench_skinny_gemm.main()
    assert e.value.code == 2
