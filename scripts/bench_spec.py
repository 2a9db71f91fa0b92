"""Fused speculative step vs plain decode step vs an unfused variant, on the GPU machine.

    python scripts/bench_spec.py --shapes llama3.1-8b --batches 1,32 --configs chain5,tree4x16

Random bf16 weights on the device: the target of the named shape and a random EAGLE-3 head of
matching size (one decoder layer of the target's width, draft vocabulary 32000 or V/3, aux
layers 2, L/2, L-3). Reported per configuration:
  plain_ms    one plain decode step (T = 1), greedy
  fused_ms    one fused spec step: verify the tree + accept + compact + draft extend + next tree
  unfused_ms  the same work as two jitted programs (verify+accept | draft) with a host read of the
              accepted tokens in between, as an engine without the fused step would run it
  ratio       fused_ms / plain_ms: with mean acceptance length tau, speculation pays when tau > ratio.
Configs: chainK = chain of K drafted tokens; treeKxM[dS] = topk K, num_draft_tokens M, num_steps S
(default 5). --breakdown also times the parts alone: the target forward over the tree, verify +
accept (+ compaction), and the draft part (extend + growth). --kv-compact-impl: the compaction
kernel, chosen once per configuration like the engine does (specjax.kernels; printed with each row).
Attention alone (always reported; the implementation the engine would pick, or --attention):
  decode_attn_ms  the target's attention of one plain decode step (T = 1), all layers
  verify_attn_ms  the target's attention of the tree verify (T = N nodes, the tree's ancestor mask),
                  all layers, over the same pages; verify/decode is the ratio the kernels aim to keep
                  <= 1.5 for 17 nodes
On CPU, a tiny smoke run: --shapes tiny --batches 2 --configs tree2x4d2 --context 24 --max-seq-len 64
--steps 2 (add --attention pallas --interpret for the generic kernel in its interpreter).
Lengths grow during the run (context .. context + steps * (S + 1)); random heads accept little.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from specjax import decode, kernels, step  # noqa: E402
from specjax.config import ModelConfig  # noqa: E402
from specjax.drafter import DraftInfo  # noqa: E402
from specjax.kv_cache import init_cache  # noqa: E402
from specjax.models.eagle import EagleConfig, EagleHead  # noqa: E402
from specjax.models.llama import Llama  # noqa: E402
from specjax.sampling import SamplingArrays  # noqa: E402
from specjax.shapes import SHAPES, shape_config  # noqa: E402
from specjax.tree import SpecConfig  # noqa: E402


def eagle3_head(shape: str, cfg: ModelConfig, dtype):
    d = dict(SHAPES[shape], num_hidden_layers=1, tie_word_embeddings=False)
    layer = ModelConfig.from_hf_dict(d)
    L = cfg.num_layers
    ecfg = EagleConfig(method="eagle3", layer=layer, target_vocab_size=cfg.vocab_size,
                       draft_vocab_size=min(32000, cfg.vocab_size // 3),
                       aux_layers=(2, L // 2, L - 3) if L >= 8 else (0, L // 2, L),  # small L: the tiny shape
                       fc_bias=False)
    head = EagleHead(ecfg, dtype, nnx.Rngs(1))
    vd = ecfg.draft_vocab_size
    ids = np.sort(np.random.default_rng(0).choice(cfg.vocab_size, vd, replace=False)).astype(np.int32)
    head.d2t[...] = jnp.asarray(ids - np.arange(vd, dtype=np.int32))
    return head, ecfg


def parse_config(name: str) -> SpecConfig:
    if name.startswith("chain"):
        k = int(name[5:])
        return SpecConfig(method="eagle3", num_steps=k, topk=1)
    body, _, depth = name[4:].partition("d")
    k, m = (int(x) for x in body.split("x"))
    return SpecConfig(method="eagle3", num_steps=int(depth or 5), topk=k, num_draft_tokens=m)


def timed(fn, state, steps):
    for _ in range(2):  # compile + warm up
        out, state = fn(state)
    jax.block_until_ready((out, state))
    t0 = time.perf_counter()
    for _ in range(steps):
        out, state = fn(state)
    jax.block_until_ready((out, state))
    return (time.perf_counter() - t0) / steps, state


MESH = None  # set by --tensor-parallel N > 1: weights and states are placed in their shardings


def bench_attention(cfg, impl, spec, batch, context, max_seq_len, page_size, steps, dtype=jnp.bfloat16):
    """(decode, verify) attention ms per step, all layers: `attend` alone with the step's shapes over
    one layer's pages, chained cfg.num_layers times inside one program (each call's output is the
    next one's query, so nothing is merged or skipped)."""
    from specjax import attention, tree as tree_lib
    from specjax.kv_cache import meta_at
    P = max_seq_len // page_size
    rng = np.random.default_rng(0)
    pages = jnp.asarray(rng.normal(size=(batch * P + 1, page_size, 2, cfg.num_kv_heads, cfg.head_dim)), dtype)
    table = jnp.asarray(1 + np.arange(batch * P, dtype=np.int32).reshape(batch, P))
    start = jnp.full((batch,), context, jnp.int32)
    N = spec.num_nodes
    parents = np.array([[-1] + [int(rng.integers(0, i)) for i in range(1, N)] for _ in range(batch)], np.int32)
    depth = np.zeros_like(parents)
    for i in range(1, N):
        depth[:, i] = depth[np.arange(batch), parents[:, i]] + 1
    tree = tree_lib.make_tree(jnp.zeros((batch, N), jnp.int32), jnp.asarray(parents), jnp.asarray(depth),
                              spec.num_steps)

    def timed_attn(T, block_mask):
        meta = meta_at(table, start, jnp.full((batch,), T, jnp.int32), T, page_size, block_mask)
        q0 = jnp.asarray(rng.normal(size=(batch, T, cfg.num_heads, cfg.head_dim)), dtype)

        @jax.jit
        def layers(q, pages):
            def body(q, _):
                return attention.attend(q, pages, meta, impl, sliding_window=cfg.sliding_window), None
            return jax.lax.scan(body, q, None, length=cfg.num_layers)[0]

        jax.block_until_ready(layers(q0, pages))
        t0 = time.perf_counter()
        for _ in range(steps):
            q0 = layers(q0, pages)
        jax.block_until_ready(q0)
        return (time.perf_counter() - t0) / steps * 1e3

    return timed_attn(1, None), timed_attn(N, tree.mask)


def place(tree):
    if MESH is None:
        return tree
    from specjax import sharding
    return sharding.shard_cache(tree, MESH)


def make_cache(cfg, rows, max_seq_len, page_size, dtype, context=None):
    P = max_seq_len // page_size
    c = init_cache(cfg, num_pages=rows * P + 1, page_size=page_size, max_slots=rows, max_seq_len=max_seq_len,
                   dtype=dtype)
    c.page_table = jnp.asarray(1 + np.arange(rows * P, dtype=np.int32).reshape(rows, P))
    if context is not None:
        c.seq_lens = jnp.full((rows,), context, jnp.int32)
    return c


def bench_plain(target, cfg, batch, context, max_seq_len, page_size, steps):
    rows = max(2, batch)
    slots = jnp.arange(rows, dtype=jnp.int32)
    active = jnp.arange(rows) < batch
    fns, w = decode.compile_steps(*nnx.split(target))
    st = place(decode.DecodeState(make_cache(cfg, rows, max_seq_len, page_size, jnp.bfloat16, context),
                                  jnp.ones((rows,), jnp.int32)))
    t, _ = timed(lambda s: fns.decode(w, s, slots, active, None, stochastic=False), st, steps)
    return t


def bench_spec(target, cfg, head, ecfg, spec, batch, context, max_seq_len, page_size, steps, breakdown=False,
               kv_compact_impl="auto"):
    rows = batch  # T = N > 1 tokens per row: no 2-row padding needed (unlike the T = 1 decode step)
    slots = jnp.arange(rows, dtype=jnp.int32)
    active = jnp.arange(rows) < batch
    info = DraftInfo("eagle3", ecfg.aux_layers)
    tgd, tp = nnx.split(target)
    dgd, dp = nnx.split(head)
    dkv = make_cache(ecfg.layer, rows, max_seq_len, page_size, jnp.bfloat16).kv
    state = place(step.init_spec_state(make_cache(cfg, rows, max_seq_len, page_size, jnp.bfloat16), dkv, spec,
                                       cfg.vocab_size, sample_drafts=False))
    impl = "reference"
    if not spec.is_chain:  # chosen once, as the engine does (a chain compacts nothing)
        kv = state.cache.kv
        args = kernels.compact_shapes(len(kv), kv[0].shape, kv[0].dtype, rows, state.cache.page_table.shape[1],
                                      spec.num_steps + 1)
        impl, _ = kernels.choose_kv_compact(kv_compact_impl, args)
    kern = kernels.Kernels(kv_compact=impl)
    fns, tw, dw = step.compile_spec_steps(info, spec, tgd, tp, dgd, dp, kernels=kern)
    toks = jax.random.randint(jax.random.key(0), (rows, context), 0, cfg.vocab_size, jnp.int32)
    lens = jnp.full((rows,), context, jnp.int32)
    _, state = fns.prefill(tw, dw, state, toks, lens, slots, None, stochastic=False)
    jax.block_until_ready(state)

    fused, state = timed(lambda s: fns.step(tw, dw, s, slots, active, None, stochastic=False), state, steps)

    # unfused: verify + accept (+ compaction) | host read | draft extend + next tree. The state is
    # donated to both programs; the first hands over the compacted cache inside the state.
    t_def, d_def = jax.tree.structure(tp), jax.tree.structure(dp)

    def part1(tw, s):
        ver = step.verify_forward(info, spec, nnx.merge(tgd, jax.tree.unflatten(t_def, tw)), s, slots, active)
        acc = step.accept(spec, s, ver, slots, active, None, False, False, kernels=kern)
        return (ver.h, ver.aux, acc.out, acc.accept_idx, acc.bonus), dataclasses.replace(s, cache=acc.cache)

    def part2(tw, dw, s, h, aux, out, idx, bonus):
        ver = step.Verified(logits=None, h=h, aux=aux, cache=None)
        acc = step.Accepted(out=out, accept_idx=idx, bonus=bonus, cache=s.cache)
        return step.draft_next(info, spec, nnx.merge(tgd, jax.tree.unflatten(t_def, tw)),
                               nnx.merge(dgd, jax.tree.unflatten(d_def, dw)), s, ver, acc, slots, active,
                               None, False)

    p1 = jax.jit(part1, donate_argnums=(1,))
    p2 = jax.jit(part2, donate_argnums=(2,))

    def unfused(s):
        mid, s = p1(tw, s)
        np.asarray(mid[2].tokens)  # the host reads the accepted tokens before drafting
        return mid[2], p2(tw, dw, s, *mid)

    unf, state = timed(unfused, state, steps)
    parts = {}
    if breakdown:  # each part alone, repeatedly on the same inputs
        fwd = jax.jit(lambda tw, s: step.verify_forward(info, spec, nnx.merge(tgd, jax.tree.unflatten(t_def, tw)),
                                                        s, slots, active).logits)
        parts["target_fwd_ms"] = timed(lambda s: (fwd(tw, s), s), state, steps)[0] * 1e3
        p1n = jax.jit(part1)
        parts["verify_accept_ms"] = timed(lambda s: (p1n(tw, s)[0][2].tokens, s), state, steps)[0] * 1e3
        mid, state = p1(tw, state)
        p2n = jax.jit(part2)
        parts["draft_ms"] = timed(lambda s: (p2n(tw, dw, s, *mid).draft_seq_lens, s), state, steps)[0] * 1e3
    n = np.asarray(fns.step(tw, dw, state, slots, active, None, stochastic=False)[0].num_accepted)
    return fused, unf, float(n[:batch].mean()), dict(parts, kv_compact=impl)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="llama3.1-8b,smollm2-135m")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--configs", default="chain5,tree4x16")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--breakdown", action="store_true")
    p.add_argument("--tensor-parallel", type=int, default=1)
    p.add_argument("--kv-compact-impl", default="auto", choices=kernels.KV_COMPACT_CHOICES)
    p.add_argument("--attention", default="auto", help="implementation at specjax.attention (resolve)")
    p.add_argument("--interpret", action="store_true", help="run a Pallas kernel in its interpreter (CPU)")
    a = p.parse_args()
    global MESH
    if a.tensor_parallel > 1:
        from specjax import sharding
        MESH = sharding.make_mesh(a.tensor_parallel)
    print("device:", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    rows = []
    for shape in a.shapes.split(","):
        cfg = shape_config(shape)
        target = Llama(cfg, jnp.bfloat16, nnx.Rngs(0))
        head, ecfg = eagle3_head(shape, cfg, jnp.bfloat16)
        from specjax import attention  # chosen once per model, as the engine does at start
        pick = dict(dtype=jnp.bfloat16, page_size=a.page_size, interpret=a.interpret, mesh=MESH)
        impl, choice = attention.resolve(a.attention, head_dim=cfg.head_dim, **pick)
        target = attention.configure(target, impl)
        head = attention.configure(head, attention.resolve(a.attention, head_dim=ecfg.layer.head_dim, **pick)[0])
        print(choice, flush=True)
        if MESH is not None:
            from specjax import sharding
            tp = a.tensor_parallel
            sharding.shard_model(target, MESH, sharding.resolve_rules(cfg, tp))
            sharding.shard_model(head, MESH, {**sharding.resolve_rules(ecfg.layer, tp), "vocab": None})
        for b in map(int, a.batches.split(",")):
            plain = bench_plain(target, cfg, b, a.context, a.max_seq_len, a.page_size, a.steps)
            for name in a.configs.split(","):
                spec = parse_config(name)
                fused, unf, tau, parts = bench_spec(target, cfg, head, ecfg, spec, b, a.context, a.max_seq_len,
                                                    a.page_size, a.steps, a.breakdown, a.kv_compact_impl)
                if MESH is None:
                    dec, ver = bench_attention(cfg, impl, spec, b, a.context, a.max_seq_len, a.page_size, a.steps)
                    parts.update(decode_attn_ms=dec, verify_attn_ms=ver, verify_over_decode_attn=ver / dec)
                r = dict(shape=shape, tp=a.tensor_parallel, batch=b, config=name, num_steps=spec.num_steps, topk=spec.topk,
                         num_draft_tokens=spec.num_draft_tokens, plain_ms=plain * 1e3, fused_ms=fused * 1e3,
                         unfused_ms=unf * 1e3, ratio=fused / plain, random_head_tau=tau, **parts)
                rows.append(r)
                print(json.dumps(r), flush=True)
    print("| shape | TP | batch | config | plain ms | fused ms | unfused ms | fused/plain "
          "| decode attn ms | verify attn ms | verify/decode attn |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        attn = (f"{r['decode_attn_ms']:.3f} | {r['verify_attn_ms']:.3f} | {r['verify_over_decode_attn']:.2f}"
                if "decode_attn_ms" in r else "- | - | -")
        print(f"| {r['shape']} | {r['tp']} | {r['batch']} | {r['config']} | {r['plain_ms']:.3f} | {r['fused_ms']:.3f} "
              f"| {r['unfused_ms']:.3f} | {r['ratio']:.2f} | {attn} |")


if __name__ == "__main__":
    main()
