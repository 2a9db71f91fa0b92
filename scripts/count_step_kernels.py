"""Kernels per decode step of the engine's programs, by op name, from the compiled HLO (no timing).

Compiles plain decoding's K-step program (`programs.plain_programs(...).decode_many`), the speculative
engine's K lite steps (`programs.spec_programs(...).step(lite=True)`) and K fused steps for a random
target of a named shape (`specjax.shapes`) with a random EAGLE-3 head, takes the body of each program's
step loop and counts its kernels (fusions and copies; other instructions launch nothing) by the jax op
name they came from, layer indices folded ("layerN", the target's layers under "verify/" or not).
Prints the totals and the op names whose counts differ between programs: what one step of one
program launches that the other's does not. On a GPU these are the kernels XLA launches; on the CPU
the fusion decisions are similar, not equal (a proxy for the GPU's counts).

    python3 scripts/count_step_kernels.py                       # tiny shape, batch 32, 8 steps
    python3 scripts/count_step_kernels.py --shape smollm2-135m --batch 1 --programs plain,fused --json k.json
    python3 scripts/count_step_kernels.py --shape smollm2-135m --batch 1 --steps 2 --programs fused \
        --tree 7:4:24 --ngram-branch 7 --draft-topk reduce          # the shipped batch-1 tree, the GPU's top-k
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


def loop_kernels(hlo: str) -> collections.Counter:
    """Kernels (fusions, copies) of the first while loop's body of a compiled module, by op name with
    the jit / loop prefix dropped and layer indices folded. A module without a loop: ValueError."""
    m = _BODY.search(hlo)
    if m is None:
        raise ValueError("no while loop in this module: compile a program of several steps (--steps >= 2)")
    counts = collections.Counter()
    for line in computations(hlo)[m.group(1)]:
        if not _KERNEL.search(line):
            continue
        name = _OP_NAME.search(line)
        name = name.group(1) if name else "(unnamed)"
        name = re.sub(r"^jit\([^)]*\)/while/body/(closed_call/)?", "", name)
        name = re.sub(r"layer\d+", "layerN", name)
        counts[re.sub(r"^verify/(?=layerN/)", "", name)] += 1  # the target's layers, in a verify scope or not
    return counts


def build(shape: str, batch: int, steps: int, pages_per_row: int = 8, page_size: int = 16,
          tree: tuple[int, int, int] = (3, 2, 5), ngram_branch: int = 0, draft_topk: str = "xla"):
    """{program name: compiled HLO text} for a random target of a named shape (specjax.shapes) and a
    random EAGLE-3 head (bench_spec.eagle3_head), float32."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import bench_spec as bs
    from specjax import programs as prog
    from specjax.decode import DecodeState
    from specjax.drafter import DraftInfo
    from specjax.kernels import Kernels
    from specjax.kv_cache import init_cache
    from specjax.models.llama import Llama
    from specjax.shapes import shape_config
    from specjax.step import init_spec_state
    from specjax.tree import SpecConfig

    cfg = shape_config(shape)
    target = Llama(cfg, jnp.float32, nnx.Rngs(0))
    head, ecfg = bs.eagle3_head(shape, cfg, jnp.float32)
    spec = SpecConfig(method="eagle3", num_steps=tree[0], topk=tree[1], num_draft_tokens=tree[2],
                      ngram_branch=ngram_branch)
    B, pps = batch, pages_per_row

    def cache(c):
        kv = init_cache(c, num_pages=1 + B * pps, page_size=page_size, max_slots=B, max_seq_len=page_size * pps,
                        dtype=jnp.float32)
        kv.page_table = jnp.asarray(1 + np.arange(B * pps, dtype=np.int32).reshape(B, pps))
        return kv
    slots, active = jnp.arange(B, dtype=jnp.int32), jnp.ones(B, bool)
    samp_all, stop = prog.init_samp(B), prog.no_stop(B)
    sp, tw, dw = prog.spec_programs(DraftInfo("eagle3", ecfg.aux_layers), spec, *nnx.split(target),
                                    *nnx.split(head), kernels=Kernels(draft_topk=draft_topk))
    pp, pw = prog.plain_programs(*nnx.split(target))
    texts = {"plain": pp.decode_many.lower(pw, DecodeState(cache=cache(cfg), last_tokens=jnp.zeros(B, jnp.int32)),
                                           samp_all, slots, active, None, num_steps=steps, want_logprobs=False,
                                           stochastic=False)}
    for name, lite in (("lite", True), ("fused", False)):
        state = init_spec_state(cache(cfg), cache(ecfg.layer).kv, spec, cfg.vocab_size)
        texts[name] = sp.step.lower(tw, dw, state, samp_all, slots, active, None, stop, num_steps=steps,
                                    lite=lite, want_logprobs=False, stochastic=False)
    return {k: v.compile().as_text() for k, v in texts.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=8, help="steps per program (>= 2: the loop whose body is counted)")
    p.add_argument("--shape", default="tiny", help="a random target of this shape (specjax.shapes)")
    p.add_argument("--programs", default="plain,lite,fused")
    p.add_argument("--tree", default="3:2:5", help="the fused program's tree, steps:topk:draft tokens")
    p.add_argument("--ngram-branch", type=int, default=0, help="n-gram branch nodes added to the tree")
    p.add_argument("--draft-topk", default="xla", choices=("xla", "reduce"),
                   help="the draft's per-level top-k (GPU engines run reduce)")
    p.add_argument("--pages-per-row", type=int, default=8, help="KV pages per row (16 tokens each)")
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
    counts = {k: loop_kernels(v) for k, v in build(a.shape, a.batch, a.steps, a.pages_per_row, tree=tree,
                                                    ngram_branch=a.ngram_branch,
                                                    draft_topk=a.draft_topk).items()
              if k in wanted}
    print(f"{a.shape}, batch {a.batch}: kernels per step " +
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
