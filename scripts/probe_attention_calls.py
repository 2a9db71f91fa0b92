"""Run the real engine (attention: the jnp reference) and check a paged-attention kernel on the very
arguments of its attention calls (CPU: the kernel in its interpreter).

Every attention call of the target and the draft goes through a probe implementation registered in
specjax.attention: it runs the reference and (for the layers chosen with --layers / the draft head)
hands its arguments and output to the host (jax.debug.callback). After generation each recorded call
runs through the kernel (--impl) and its max abs error on the valid queries (t < kv_len - q_start)
against an f32 reference on the same (bf16) inputs is reported per call kind, beside the error of the
engine's own bf16 reference output (the rounding floor a correct bf16 kernel stays near):

    prefill   T > 1, no block mask           (a prompt piece, or the draft's extend; causal)
    decode    T == 1, no block mask
    verify    block mask, no mask_start      (tree verification)
    grow      block mask and mask_start      (draft tree growth)

The kernel runs in its interpreter on the CPU and for real on a GPU (there the same command checks
the wgmma path the interpreter replaces by plain dots).

    PYTHONPATH=. python3 scripts/probe_attention_calls.py --max-tokens 24 --max-check 40
    PYTHONPATH=. python3 scripts/probe_attention_calls.py --max-tokens 128 --repeat 3 --layers 0,29 \
        --max-check 100000 --per-kind 100000     # every call of bench_generate's batch-1 run (CPU: ~20 min)
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from jax._src import source_info_util  # noqa: E402

from pallas_kernels.paged_attention import paged_attention_reference  # noqa: E402
from specjax import attention  # noqa: E402

RECORDS: list[dict] = []


def kind_of(T, has_block, has_mask_start):
    if has_block:
        return "grow" if has_mask_start else "verify"
    return "decode" if T == 1 else "prefill"


def make_probe(keep):
    def probe(q, kv_pages, page_table, q_start, kv_len, block_mask=None, *, sliding_window=None, scale=None,
              mask_start=None):
        out = paged_attention_reference(q, kv_pages, page_table, q_start, kv_len, block_mask,
                                        sliding_window=sliding_window, scale=scale, mask_start=mask_start)
        tag = str(source_info_util.current_name_stack())
        if keep(tag):
            def record(q, kv_pages, page_table, q_start, kv_len, block_mask, mask_start, out):
                RECORDS.append(dict(tag=tag, q=np.asarray(q), kv_pages=np.asarray(kv_pages),
                                    page_table=np.asarray(page_table), q_start=np.asarray(q_start),
                                    kv_len=np.asarray(kv_len),
                                    block_mask=None if block_mask is None else np.asarray(block_mask),
                                    mask_start=None if mask_start is None else np.asarray(mask_start),
                                    out=np.asarray(out), window=sliding_window))
            jax.debug.callback(record, q, kv_pages, page_table, q_start, kv_len, block_mask, mask_start, out)
        return out
    return probe


def check(rec, fn):
    args = [jnp.asarray(rec[k]) for k in ("q", "kv_pages", "page_table", "q_start", "kv_len")]
    bm = None if rec["block_mask"] is None else jnp.asarray(rec["block_mask"])
    ms = None if rec["mask_start"] is None else jnp.asarray(rec["mask_start"])
    got = np.asarray(fn(*args, bm, sliding_window=rec["window"], mask_start=ms).astype(jnp.float32))
    ref = np.asarray(rec["out"].astype(np.float32))  # the engine's (bf16 reference) output
    f32 = [x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in args]
    exact = np.asarray(paged_attention_reference(*f32, bm, sliding_window=rec["window"], mask_start=ms))
    n_new = np.maximum(rec["kv_len"] - rec["q_start"], 0)
    errs, ref_errs, scale = [], [], []
    for b, n in enumerate(n_new):
        n = min(int(n), got.shape[1])
        if not n:
            continue
        errs.append(float(np.abs(got[b, :n] - exact[b, :n]).max()))
        ref_errs.append(float(np.abs(ref[b, :n] - exact[b, :n]).max()))
        scale.append(float(np.abs(exact[b, :n]).max()))
    return errs or [0.0], ref_errs or [0.0], scale or [0.0], got


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--max-batch", type=int, default=1)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--layers", default="0", help="target layers to record (comma list); the draft head always")
    p.add_argument("--max-check", type=int, default=40, help="kernel calls to run (interpret mode is slow)")
    p.add_argument("--per-kind", type=int, default=8, help="at most this many checked calls per (who, kind, shape)")
    p.add_argument("--kv-bucket", type=int, default=10**9, help="sample per kv_len // this too")
    p.add_argument("--impl", default="mosaic_gpu")
    p.add_argument("--num-splits", type=int, default=None)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1,
                   help="generate this many times (as bench_generate: 3; the prefix cache then holds the prompts) "
                   "and check the calls of the last")
    p.add_argument("--dump", default=None, help="np.savez the first mismatching call here")
    a = p.parse_args(argv)

    layers = {f"layer{i}" for i in a.layers.split(",") if i != ""}

    def keep(tag):
        parts = tag.split("/")
        lay = [x for x in parts if x.startswith("layer")]
        return bool(set(lay) & layers) if lay else True  # the target's chosen layers; the draft head always

    attention.register("probe", lambda impl: make_probe(keep))
    from specjax import LLM, SamplingParams
    from specjax.assets import DEFAULT_HEAD_DIR
    llm = LLM(dtype="bfloat16", max_batch=a.max_batch, max_seq_len=a.max_seq_len, draft=str(DEFAULT_HEAD_DIR),
              attention="probe", speculate_below=None)
    print("engine:", llm.engine.attention_choice, flush=True)
    texts = ["Write a short essay about a city at night.", "Explain how vaccines work to a ten-year-old.",
             "Give five tips related to time management."][: a.prompts]
    ids = [llm.tokenizer.encode(llm.apply_chat_template([{"role": "user", "content": t}]), add_special_tokens=False)
           for t in texts]
    print("prompt lengths:", [len(x) for x in ids], flush=True)
    for r in range(a.repeat):
        RECORDS.clear()
        t0 = time.time()
        outs = llm.generate(ids, [SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)] * len(ids))
        jax.effects_barrier()
        print(f"generate {r + 1} in {time.time() - t0:.1f}s; tau:", [o.accept_len_mean for o in outs], flush=True)
    print("recorded calls:", len(RECORDS), flush=True)

    kw = {} if a.num_splits is None else {"num_splits": a.num_splits}
    interpret = a.impl not in ("reference", "cudnn") and jax.default_backend() == "cpu"
    impl = attention.AttnImpl(a.impl, interpret=interpret, **kw)
    fn = attention.implementation(impl)
    seen = collections.Counter()
    summary = collections.defaultdict(list)
    checked = 0
    dumped = False
    for i, rec in enumerate(RECORDS):
        who = "draft" if "layer" not in rec["tag"] else [x for x in rec["tag"].split("/") if x.startswith("layer")][0]
        T = rec["q"].shape[1]
        kind = kind_of(T, rec["block_mask"] is not None, rec["mask_start"] is not None)
        key = (who, kind, rec["q"].shape, None if rec["block_mask"] is None else rec["block_mask"].shape,
               int(rec["kv_len"].max()) // a.kv_bucket)
        if seen[key] >= a.per_kind or checked >= a.max_check:
            continue
        seen[key] += 1
        checked += 1
        t = time.time()
        errs, ref_errs, scale, got = check(rec, fn)
        row = dict(i=i, who=who, tag=rec["tag"], kind=kind, q=list(rec["q"].shape), pages=list(rec["kv_pages"].shape),
                   P=rec["page_table"].shape[1], q_start=rec["q_start"].tolist(), kv_len=rec["kv_len"].tolist(),
                   mask_start=None if rec["mask_start"] is None else rec["mask_start"].tolist(),
                   W=None if rec["block_mask"] is None else rec["block_mask"].shape[2],
                   err=[round(e, 4) for e in errs], ref_err=[round(e, 4) for e in ref_errs],
                   max_abs_out=[round(e, 2) for e in scale], s=round(time.time() - t, 1))
        print(json.dumps(row), flush=True)
        summary[(who, kind)].append((max(errs), max(ref_errs)))
        if a.dump and not dumped and max(errs) > 4 * max(ref_errs) + 1e-2:
            np.savez(a.dump, **{k: v for k, v in rec.items() if v is not None and k != "tag"}, got=got)
            dumped = True
    print("\nmax abs error on valid queries vs an f32 reference on the same inputs, per (who, kind):")
    print("  kernel max / median, and the engine's bf16 reference max (the rounding floor)")
    for (who, kind), es in sorted(summary.items()):
        k, r = np.array(es).T
        print(f"  {who:8} {kind:8} n={len(es):3d} kernel max={k.max():.4f} median={np.median(k):.4f} "
              f"bf16-ref max={r.max():.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
