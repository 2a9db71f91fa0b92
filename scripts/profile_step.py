"""Where a decode step's device time goes, by named scope (GPU): the kernels of one traced
`LLM.generate` call (jax.profiler), each mapped to the jax named scope of its HLO instruction
(the optimized HLO that XLA dumps), summed per scope and divided by the decode steps the engine ran.

    python scripts/profile_step.py                          # shipped head, its default tree, batch 1
    python scripts/profile_step.py --draft none             # plain decoding
    python scripts/profile_step.py --draft DIR --num-steps 5 --topk 4 --num-draft-tokens 16 --batch 1,32
    python scripts/profile_step.py --dtype float32 --max-tokens 16 --draft none   # CPU smoke run
    python scripts/profile_step.py --prompt-set sum --module-re prefill   # the prefill of long prompts

Prints per batch: kernels per step, device µs per step, and the top scopes (count / µs per step).
The µs are sums of kernel durations: XLA launches its GEMM fusions with programmatic dependent launch
(PDL), so such a kernel starts before its predecessor ends and waits inside it; the sum overstates the
device's busy time (H200: 1 326 µs per step with PDL, 1 252 with `--xla_gpu_enable_pdl=false`, while
the engine ran 3 % faster with PDL; docs/benchmarks.md). Compare profiles taken with the same flags.
Scopes are the jax named scopes (verify, accept, compact, draft, ...) below the program's loop;
`--depth` sets how many levels are kept. Kernels of another program (prefill) are left out by
module name (`--module-re`).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

DUMP = None
if __name__ == "__main__" and "--no-dump" not in sys.argv:  # before jax starts; not when imported (tests)
    DUMP = tempfile.mkdtemp(prefix="specjax_hlo_")
    # command buffers (CUDA graphs) off: a graph's kernels are reported under the graph's one HLO
    # instruction, so no kernel could be mapped to its scope; kernel durations are the same
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text"
                               + ("" if "--keep-command-buffers" in sys.argv else
                                  " --xla_gpu_enable_command_buffer=")).strip()
    # the persistent compilation cache off: an executable loaded from it is not compiled, so XLA
    # dumps no HLO for it and its kernels could not be mapped to scopes
    os.environ.setdefault("SPECJAX_COMPILE_CACHE", "off")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

from specjax import LLM, SamplingParams  # noqa: E402
from specjax.assets import DEFAULT_HEAD_DIR, PROMPTS_DIR  # noqa: E402
from specjax.kernels import DRAFT_TOPK_CHOICES  # noqa: E402
from specjax.tree import SpecConfig  # noqa: E402

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name=\"([^\"]*)\"")
_NOISE = re.compile(r"^(jit\(.*\)|jvp\(.*\)|transpose\(.*\)|while|body|cond|closed_call|checkpoint|"
                    r"remat|pjit|eval_jaxpr|branch_\d+_fun|scan|vmap\(.*\)|cond_\d+|)$")


def scope_map(dump_dir: str) -> dict[tuple[str, str], str]:
    """(module name, instruction name) -> op_name, from the optimized HLO XLA dumped."""
    out = {}
    for f in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")):
        text = Path(f).read_text()
        m = re.search(r"^HloModule\s+([\w.\-]+)", text, re.M)
        mod = m.group(1) if m else Path(f).name
        for line in text.splitlines():
            mi = _INSTR.match(line)
            if mi:
                out[(mod, mi.group(1))] = mi.group(2)
    return out


def scope_of(op_name: str, depth: int) -> str:
    parts = [p for p in op_name.split("/") if not _NOISE.match(p)]
    # keep named scopes (words), drop the primitive at the end
    scopes = parts[:-1] if len(parts) > 1 else parts
    return re.sub(r"layers?_?\d+", "layer*", "/".join(scopes[:depth])) or "(top)"


def op_of(op_name: str) -> str:
    """The whole filtered op_name (scopes and the primitive), layer numbers folded: one row per
    instruction kind of the step (`--ops`)."""
    parts = [p for p in op_name.split("/") if not _NOISE.match(p)]
    return re.sub(r"layers?_?\d+", "layer*", "/".join(parts)) or "(top)"


def op_table(evs, smap, keep_unmapped: bool = True) -> dict[tuple[str, str], list]:
    """(op kind (op_of), kernel name) -> [kernels, ns] over kernel events (name, ns, module, hlo op);
    an event without an op name is keyed by its HLO instruction (or dropped: keep_unmapped False)."""
    by = defaultdict(lambda: [0, 0.0])
    for name, dur, mod, op in evs:
        opn = smap.get((mod, op))
        if opn is None and not keep_unmapped:
            continue
        key = (op_of(opn) if opn else f"(unmapped) {op}", name.split(".")[0][:40])
        by[key][0] += 1
        by[key][1] += dur
    return by


def kernel_events(trace_dir: str):
    from jax.profiler import ProfileData
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise SystemExit(f"no xplane.pb under {trace_dir}")
    data = ProfileData.from_file(files[0])
    evs, device = [], False
    for plane in data.planes:
        gpu = plane.name.startswith("/device:GPU")
        if not (gpu or plane.name == "/host:CPU"):
            continue
        for line in plane.lines:
            for e in line.events:
                st = dict(e.stats)
                if "hlo_op" not in st:
                    continue
                evs.append((gpu, e.name, float(e.duration_ns), str(st.get("hlo_module", "")), str(st["hlo_op"])))
        device |= gpu
    # on a GPU, the device planes hold the kernels; the host plane's ops are launches
    return [e[1:] for e in evs if e[0] == device], device


def set_prompts(name: str, n: int) -> list[str]:
    """The first turns of the first n prompts of specjax/assets/prompts/{name}.jsonl, repeated to n."""
    with open(PROMPTS_DIR / f"{name}.jsonl") as fh:
        texts = [json.loads(line)["turns"][0] for line in fh]
    return (texts * (n // len(texts) + 1))[:n]


def run(llm, batch, max_tokens, temperature, depth, module_re, top, smap_cache, ops=0, prompt_set=None):
    texts = (set_prompts(prompt_set, batch) if prompt_set else
             [f"Write a long story about a {t}." for t in (["lighthouse", "river", "clock", "garden", "train",
                                                            "mountain", "violin", "desert"] * (batch // 8 + 1))[:batch]])
    prompts = [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature, seed=0)
    for _ in range(2):
        llm.generate(prompts, params)
    eng = llm.engine
    before = dict(eng.stats())
    tdir = tempfile.mkdtemp(prefix="specjax_prof_")
    with jax.profiler.trace(tdir):
        llm.generate(prompts, params)
    after = eng.stats()
    steps = {k: after.get(k, 0) - before.get(k, 0) for k in after if k.endswith("_dispatch_steps")}
    nsteps = sum(steps.values())
    evs, on_device = kernel_events(tdir)
    if DUMP:
        smap_cache.update(scope_map(DUMP))
    mre = re.compile(module_re)
    by_scope = defaultdict(lambda: [0, 0.0])
    by_module = defaultdict(lambda: [0, 0.0])
    unmapped = 0
    for name, dur, mod, op in evs:
        by_module[mod][0] += 1
        by_module[mod][1] += dur
        if not mre.search(mod):
            continue
        opn = smap_cache.get((mod, op))
        if opn is None:
            unmapped += 1
            sc = f"(unmapped) {op.split('.')[0]}"
        else:
            sc = scope_of(opn, depth)
        by_scope[sc][0] += 1
        by_scope[sc][1] += dur
    by_op = op_table([e for e in evs if mre.search(e[2])], smap_cache, keep_unmapped=False)
    total_n = sum(v[0] for v in by_scope.values())
    total_t = sum(v[1] for v in by_scope.values())
    per = max(nsteps, 1)
    events = "GPU kernels" if on_device else "CPU ops"
    print(f"\n== batch {batch}, temperature {temperature}: {nsteps} decode steps ({steps}); device events: {events}; "
          f"prompts of {sum(len(llm.tokenizer.encode(p, add_special_tokens=False)) for p in prompts) / batch:.0f} "
          "tokens on average", flush=True)
    print("modules (events, ms):", {m: (n, round(t / 1e6, 2)) for m, (n, t) in
                                    sorted(by_module.items(), key=lambda kv: -kv[1][1])[:8]})
    print(f"selected (--module-re {module_re!r}): {total_n / per:.1f} kernels / step, "
          f"{total_t / 1e3 / per:.1f} us / step; {unmapped} events without a scope")
    rows = sorted(by_scope.items(), key=lambda kv: -kv[1][1])
    print(f"| scope | kernels / step | us / step | share |\n|---|---|---|---|")
    for sc, (n, t) in rows[:top]:
        print(f"| {sc} | {n / per:.1f} | {t / 1e3 / per:.1f} | {100 * t / max(total_t, 1):.1f} % |")
    op_rows = sorted(by_op.items(), key=lambda kv: -kv[1][1])
    if ops:
        print(f"| op (scopes/primitive) | kernel | kernels / step | us / step |\n|---|---|---|---|")
        for (op, kname), (n, t) in op_rows[:ops]:
            print(f"| {op} | {kname} | {n / per:.2f} | {t / 1e3 / per:.2f} |")
    return dict(batch=batch, steps=nsteps, kernels_per_step=total_n / per, us_per_step=total_t / 1e3 / per,
                scopes={sc: dict(kernels=n / per, us=t / 1e3 / per) for sc, (n, t) in rows},
                ops=[dict(op=op, kernel=kname, kernels=n / per, us=t / 1e3 / per) for (op, kname), (n, t) in op_rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--draft", default="default", help="'default' (the shipped head), 'none' (plain), 'ngram' or a dir")
    p.add_argument("--num-steps", type=int)
    p.add_argument("--topk", type=int)
    p.add_argument("--num-draft-tokens", type=int)
    p.add_argument("--ngram-branch", type=int, default=0, help="n-gram nodes added to the tree (SpecConfig.ngram_branch)")
    p.add_argument("--batch", default="1")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--draft-topk", choices=DRAFT_TOPK_CHOICES, default="auto",
                   help="the draft's top-k (LLM(draft_topk=...); auto: the engine's choice)")
    p.add_argument("--attention", default="auto", help="paged-attention implementation (LLM(attention=...))")
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--ops", type=int, default=0, help="also print the N costliest instructions (op_name, kernel)")
    p.add_argument("--module-re", default=r"^(?!.*prefill)")
    p.add_argument("--prompt-set", help="prompts from specjax/assets/prompts/NAME.jsonl (e.g. sum: long ones) "
                   "instead of the short story requests")
    p.add_argument("--json")
    p.add_argument("--no-dump", action="store_true", help="(read before jax starts) leave XLA_FLAGS alone")
    p.add_argument("--keep-command-buffers", action="store_true",
                   help="(read before jax starts) profile with CUDA graphs on: totals only, no scopes")
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batch.split(",")]
    kw = {}
    if a.draft == "none":
        draft = None
    elif a.draft == "default":
        draft = str(DEFAULT_HEAD_DIR)
    else:
        draft = a.draft
    if a.num_steps:
        from specjax.llm import draft_method
        kw["spec"] = SpecConfig(method=draft_method(draft), num_steps=a.num_steps, topk=a.topk or 1,
                                num_draft_tokens=a.num_draft_tokens or a.num_steps, ngram_branch=a.ngram_branch)
    llm = LLM(a.model, dtype=a.dtype, max_batch=max(batches), max_seq_len=2048, draft=draft,
              draft_topk=a.draft_topk, attention=a.attention, **kw)
    print("attention:", llm.engine.attention_choice)
    smap, rows = {}, []
    for b in batches:
        rows.append(run(llm, b, a.max_tokens, a.temperature, a.depth, a.module_re, a.top, smap, a.ops, a.prompt_set))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
