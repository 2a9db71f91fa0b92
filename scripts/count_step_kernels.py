"""Kernels per decode step of the engine's programs, by op name, from the compiled HLO (no timing).

Compiles plain decoding's K-step program (`programs.plain_programs(...).decode_many`), the speculative
engine's K lite steps (`programs.spec_programs(...).step(lite=True)`) and K fused steps for a random
target of a named shape (`specjax.shapes`) with a random EAGLE-3 head, takes the body of each program's
step loop and counts its kernels (fusions and copies; other instructions launch nothing) by the jax op
name they came from, layer indices folded ("layerN", the target's layers under "verify/" or not).
Prints the totals and the op names whose counts differ between programs: what one step of one
program launches that the other's does not. On a GPU these are the kernels XLA launches; on the CPU
the fusion decisions are similar, not equal (a proxy for the GPU's counts).

--target h100 / h200 compiles the programs for that GPU without one (XLA's GPU compiler with a target
description instead of a device: jax's compile-only devices), with the engine's GPU choices: bf16
weights, the Mosaic GPU attention (at most `attention.split_cap` splits, as the engine compiles a
dispatch of short rows; plain decoding too, where an engine of one row runs cuDNN's, whose lowering
needs the cuDNN library), the Mosaic KV compaction and the draft top-k as one reduction. Kernels are
then fusions, copies and custom calls (the Mosaic kernels). It needs jax's CUDA plugin of this jax's
version (`pip install jax-cuda12-plugin==V jax-cuda12-pjrt==V`), no GPU, driver or CUDA libraries.
Without a GPU there is no GEMM autotuning: XLA's GEMM tilings are its defaults (at M = 1 split-K ones
with extra reduction kernels, so plain decoding's count is high), not the tuned ones; the other
kernels are the GPU's. Checked against an H200 profile of the engine's fused step (docs/benchmarks.md,
"Kernels of a GPU step counted without a GPU"): the same 12 kernels per verify layer. --handover
compiles the fused program with row hand-over, the engine's default for one row.

    python3 scripts/count_step_kernels.py                       # tiny shape, batch 32, 8 steps
    python3 scripts/count_step_kernels.py --shape smollm2-135m --batch 1 --programs plain,fused --json k.json
    python3 scripts/count_step_kernels.py --shape smollm2-135m --batch 1 --steps 2 --programs fused \
        --tree 7:4:24 --ngram-branch 7 --draft-topk reduce          # the shipped batch-1 tree, the GPU's top-k
    python3 scripts/count_step_kernels.py --target h100 --shape smollm2-135m --batch 1 --programs fused \
        --tree 7:4:24 --ngram-branch 7 --draft-vocab 16384 --pages-per-row 64 --handover --list fused
                                            # the engine's batch-1 program on an H100, its kernels in order
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))  # bench_spec's random EAGLE-3 head

_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$")
_BODY = re.compile(r"while\(.*body=%?([\w.\-]+)")
_KERNEL = re.compile(r"= \S.*? (fusion|copy)\(")
_GPU_KERNEL = re.compile(r"= \S.*? (fusion|copy|custom-call)\(")  # a GPU's custom calls launch kernels
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def computations(hlo: str) -> dict[str, list[str]]:
    """The instruction lines of each computation of an HLO module's text, by computation name."""
    comps, cur = {}, None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m:
            cur = m.group(1)
            comps[cur] = []
        elif line.startswith("}"):
            cur = None
        elif cur is not None:
            comps[cur].append(line)
    return comps


def loop_body_kernels(hlo: str, gpu: bool = False) -> list[tuple[str, str]]:
    """(instruction, op name) of each kernel of the first while loop's body of a compiled module, in
    order: fusions and copies, and on a GPU custom calls. Op names with the jit / loop prefix dropped.
    A module without a loop: ValueError."""
    m = _BODY.search(hlo)
    if m is None:
        raise ValueError("no while loop in this module: compile a program of several steps (--steps >= 2)")
    pattern = _GPU_KERNEL if gpu else _KERNEL
    out = []
    for line in computations(hlo)[m.group(1)]:
        if not pattern.search(line):
            continue
        name = _OP_NAME.search(line)
        name = name.group(1) if name else "(unnamed)"
        out.append((line.split("=")[0].strip().lstrip("%"), re.sub(r"^jit\([^)]*\)/while/body/(closed_call/)*", "", name)))
    return out


def loop_kernels(hlo: str, gpu: bool = False) -> collections.Counter:
    """Kernels of the first while loop's body of a compiled module (loop_body_kernels) by op name,
    layer indices folded. A module without a loop: ValueError."""
    counts = collections.Counter()
    for _, name in loop_body_kernels(hlo, gpu):
        name = re.sub(r"layer\d+", "layerN", name)
        counts[re.sub(r"^verify/(?=layerN/)", "", name)] += 1  # the target's layers, in a verify scope or not
    return counts


# Public facts of the GPUs a program can be compiled for without one (XLA's GpuTargetConfig, text form).
GPU_TARGETS = {
    "h100": dict(name="NVIDIA H100 80GB HBM3", memory=84942979072, bandwidth=3352320000000),
    "h200": dict(name="NVIDIA H200", memory=150754820096, bandwidth=4800000000000),
}


def gpu_target_config(target: str) -> str:
    """XLA's target description of a Hopper GPU (GpuTargetConfigProto as text): what the compiler reads
    from a device when it has one (132 SMs, 228 KiB of shared memory per SM, 50 MiB of L2)."""
    t = GPU_TARGETS[target]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {t["bandwidth"]}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {t["memory"]}
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{t["name"]}"
"""


def compile_only_device(target: str):
    """A jax device of the named GPU that programs compile for and never run on."""
    import jax
    from jax.experimental import topologies
    try:
        topo = topologies.get_topology_desc(target, "cuda", target_config=gpu_target_config(target),
                                            topology="1x1x1")
    except Exception as e:  # noqa: BLE001 - no CUDA plugin, or one of another jax version: say which to install
        v = jax.__version__
        raise SystemExit(f"--target {target} compiles for a GPU through jax's CUDA plugin, which is missing or does "
                         f"not load here ({type(e).__name__}: {str(e)[:200]}); install the plugin of this jax: "
                         f"pip install jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v}") from e
    return topo.devices[0]


def build(shape: str, batch: int, steps: int, pages_per_row: int = 8, page_size: int = 16,
          tree: tuple[int, int, int] = (3, 2, 5), ngram_branch: int = 0, draft_topk: str = "xla",
          target: str = "cpu", draft_vocab: int | None = None, programs=("plain", "lite", "fused"),
          handover: bool = False):
    """{program name: compiled HLO text} for a random target of a named shape (specjax.shapes) and a
    random EAGLE-3 head (bench_spec.eagle3_head): float32 on the CPU; for a GPU target (GPU_TARGETS)
    bf16 with the engine's GPU kernels, compiled for a compile-only device of that GPU. handover: the
    fused program with row hand-over (programs.Successors; twice the slots, as the engine's)."""
    import contextlib
    from unittest import mock

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import bench_spec as bs
    from specjax import attention as attn_lib
    from specjax import programs as prog
    from specjax.decode import DecodeState
    from specjax.drafter import DraftInfo
    from specjax.kernels import Kernels
    from specjax.kv_cache import init_cache
    from specjax.models.llama import Llama
    from specjax.shapes import shape_config
    from specjax.step import init_spec_state
    from specjax.tree import SpecConfig

    gpu = target != "cpu"
    dtype = jnp.bfloat16 if gpu else jnp.float32
    cfg = shape_config(shape)
    target_model = Llama(cfg, dtype, nnx.Rngs(0))
    head, ecfg = bs.eagle3_head(shape, cfg, dtype, draft_vocab=draft_vocab)
    spec = SpecConfig(method="eagle3", num_steps=tree[0], topk=tree[1], num_draft_tokens=tree[2],
                      ngram_branch=ngram_branch)
    B, pps = batch, pages_per_row
    D = 2 * B if handover else B  # device slots
    kernels = Kernels(draft_topk=draft_topk)
    plain_model, max_splits, place = target_model, None, (lambda tree_: tree_)
    if gpu:  # the engine's choices on a Hopper GPU (specjax.attention.resolve, specjax.kernels)
        device = compile_only_device(target)
        sharding = jax.sharding.SingleDeviceSharding(device)
        mosaic = attn_lib.AttnImpl("mosaic_gpu", fuse_write=attn_lib.fuse_write_default())  # $SPECJAX_FUSE_KV_WRITE
        target_model, head = attn_lib.configure(target_model, mosaic), attn_lib.configure(head, mosaic)
        # plain decoding with the Mosaic attention too: a plain engine of one row runs cuDNN's, whose lowering
        # needs the cuDNN library (not part of the plugin), so its attention is not the engine's there
        plain_model = attn_lib.configure(plain_model, mosaic)
        kernels = Kernels(kv_compact="mosaic", draft_topk=draft_topk)
        max_splits = attn_lib.split_cap(page_size * pps, B)  # rows of this cache are short or not

        def place(tree_):  # arrays -> abstract values on the compile-only device
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
                                if hasattr(x, "shape") and hasattr(x, "dtype") else x, tree_)

    def cache(c):
        kv = init_cache(c, num_pages=1 + D * pps, page_size=page_size, max_slots=D, max_seq_len=page_size * pps,
                        dtype=dtype)
        kv.page_table = jnp.asarray(1 + np.arange(D * pps, dtype=np.int32).reshape(D, pps))
        return kv
    slots, active = jnp.arange(B, dtype=jnp.int32), jnp.ones(B, bool)
    samp_all, stop = prog.init_samp(D), prog.no_stop(B)
    succ = prog.Successors(jnp.arange(B, D, dtype=jnp.int32), prog.no_stop(B)) if handover else None
    sp, tw, dw = prog.spec_programs(DraftInfo("eagle3", ecfg.aux_layers), spec, *nnx.split(target_model),
                                    *nnx.split(head), kernels=kernels)
    pp, pw = prog.plain_programs(*nnx.split(plain_model))
    texts = {}
    # kv_compact refuses the Mosaic kernel where jax's default backend is not a GPU: here the programs are
    # for a GPU whatever the default backend is
    gpu_backend = mock.patch("jax.default_backend", lambda: "gpu") if gpu else contextlib.nullcontext()
    with gpu_backend:
        if "plain" in programs:
            state = DecodeState(cache=cache(cfg), last_tokens=jnp.zeros(B, jnp.int32))
            texts["plain"] = pp.decode_many.lower(*place((pw, state, samp_all, slots, active)), None,
                                                  num_steps=steps, want_logprobs=False, stochastic=False)
        for name, lite in (("lite", True), ("fused", False)):
            if name not in programs:
                continue
            state = init_spec_state(cache(cfg), cache(ecfg.layer).kv, spec, cfg.vocab_size)
            texts[name] = sp.step.lower(*place((tw, dw, state, samp_all, slots, active)), None, place(stop), None,
                                        None if lite else place(succ), num_steps=steps, lite=lite,
                                        want_logprobs=False, stochastic=False, max_splits=max_splits)
        return {k: v.compile().as_text() for k, v in texts.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=8, help="steps per program (>= 2: the loop whose body is counted)")
    p.add_argument("--shape", default="tiny", help="a random target of this shape (specjax.shapes)")
    p.add_argument("--programs", default="plain,lite,fused")
    p.add_argument("--tree", default="3:2:5", help="the fused program's tree, steps:topk:draft tokens")
    p.add_argument("--ngram-branch", type=int, default=0, help="n-gram branch nodes added to the tree")
    p.add_argument("--draft-topk", choices=("xla", "reduce"),
                   help="the draft's per-level top-k (default: reduce for a GPU target, as GPU engines run, else xla)")
    p.add_argument("--pages-per-row", type=int, default=8, help="KV pages per row (16 tokens each)")
    p.add_argument("--target", default="cpu", choices=("cpu",) + tuple(GPU_TARGETS),
                   help="compile for the CPU (float32), or for this GPU without one (bf16, the engine's GPU kernels)")
    p.add_argument("--draft-vocab", type=int, help="the random head's draft vocabulary (the shipped head: 16384)")
    p.add_argument("--handover", action="store_true",
                   help="the fused program with row hand-over (the engine's default for one row)")
    p.add_argument("--list", metavar="PROGRAM", help="also print this program's step kernels in order")
    p.add_argument("--json", help="write {program: {op name: kernels}} here")
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error("--steps must be >= 2: a one-step program has no loop to count")
    wanted = [w.strip() for w in a.programs.split(",") if w.strip()]
    unknown = set(wanted) - {"plain", "lite", "fused"}
    if unknown:
        p.error(f"unknown programs {sorted(unknown)}: choose from plain, lite, fused")
    try:
        tree = tuple(int(x) for x in a.tree.split(":"))
        assert len(tree) == 3
    except (ValueError, AssertionError):
        p.error(f"--tree must be steps:topk:draft_tokens (three ints), got {a.tree!r}")
    if a.list and a.list not in wanted:
        p.error(f"--list {a.list}: not among --programs {a.programs}")
    gpu = a.target != "cpu"
    texts = build(a.shape, a.batch, a.steps, a.pages_per_row, tree=tree, ngram_branch=a.ngram_branch,
                  draft_topk=a.draft_topk or ("reduce" if gpu else "xla"), target=a.target, draft_vocab=a.draft_vocab,
                  programs=wanted, handover=a.handover)
    counts = {k: loop_kernels(texts[k], gpu) for k in wanted}
    if a.list:
        for instr, name in loop_body_kernels(texts[a.list], gpu):
            print(f"{instr[:36]:36s} {name[:140]}")
    if gpu and "plain" in wanted:
        print(f"note: plain decoding compiled with the Mosaic attention; an engine of {a.batch} row(s) on the GPU "
              + ("runs cuDNN's (its lowering needs the cuDNN library, absent here)" if a.batch == 1 else "runs the same"))
    print(f"{a.shape}, batch {a.batch}, {a.target}: kernels per step " +
          ", ".join(f"{k} {sum(c.values())}" for k, c in counts.items()))
    names = sorted(set().union(*counts.values()))
    print("  ".join(f"{k:>6s}" for k in counts) + "  op name (rows where the programs differ)")
    for n in names:
        row = [c[n] for c in counts.values()]
        if len(set(row)) > 1:
            print("  ".join(f"{v:6d}" for v in row) + f"  {n[:120]}")
    if a.json:
        Path(a.json).write_text(json.dumps({k: dict(c) for k, c in counts.items()}, indent=1))
    return counts


if __name__ == "__main__":
    main()
