"""Fused speculative step vs plain decode step vs an unfused variant, on the GPU machine.

    python scripts/bench_spec.py --shapes llama3.1-8b --batches 1,32 --configs chain5,tree4x16

Random bf16 weights on the device: the target of the named shape and a random EAGLE-3 head of
matching size (one decoder layer of the target's width, draft vocabulary 32000 or V/3, aux
layers 2, L/2, L-3). The timed programs are the engine's own (specjax.programs, through an
Engine holding `batch` requests of `context` random prompt tokens, prefilled by the engine),
called as the engine calls them: rows bucketed as the engine buckets them (a batch of 1 runs 2
rows), per-slot sampling parameters, the rows' next trees returned. Reported per configuration,
greedy and sampling (temperature 0.7, top-p 0.9: the `stochastic` programs):
  plain_ms      one plain decode step: the engine's decode_many with num_steps=1
  plain_k8_ms   per step of decode_many with num_steps=8 (what the engine dispatches in steady state)
  fused_ms      one fused spec step (programs.spec_programs `step`): verify the tree + accept +
                compact + draft extend + next tree
  unfused_ms    (greedy) the same work as two jitted programs (verify+accept | draft) with a host
                read of the accepted tokens in between, as an engine without the fused step would
                run it
  ratio         fused_ms / plain_ms: with mean acceptance length tau, speculation pays when tau > ratio.
Configs: chainK = chain of K drafted tokens; treeKxM[dS] = topk K, num_draft_tokens M, num_steps S
(default 5). --breakdown also times the parts alone (greedy): the target forward over the tree,
verify + accept (+ compaction), and the draft part (extend + growth). --kv-compact-impl and
--attention: the kernels, which the engine chooses once at start (specjax.kernels,
specjax.attention; printed with each row).
Attention alone (always reported; the implementation the engine picks, or --attention):
  decode_attn_ms  the target's attention of one plain decode step (T = 1), all layers
  verify_attn_ms  the target's attention of the tree verify (T = N nodes, the tree's ancestor mask),
                  all layers, over the same pages; verify/decode is the ratio the kernels aim to keep
                  <= 1.5 for 17 nodes
On CPU, a tiny smoke run: --shapes tiny --batches 2 --configs tree2x4d2 --context 24 --max-seq-len 64
--steps 2 --dtype float32 (add --attention pallas --interpret for the generic kernel in its interpreter).
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

from specjax import attention, kernels, programs as prog, step  # noqa: E402
from specjax.config import ModelConfig  # noqa: E402
from specjax.drafter import DraftInfo  # noqa: E402
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine  # noqa: E402
from specjax.models.eagle import EagleConfig, EagleHead  # noqa: E402
from specjax.models.llama import Llama  # noqa: E402
from specjax.request import Request  # noqa: E402
from specjax.sampling_params import SamplingParams  # noqa: E402
from specjax.shapes import SHAPES, shape_config  # noqa: E402
from specjax.tree import SpecConfig  # noqa: E402


def eagle3_head(shape: str, cfg: ModelConfig, dtype, draft_vocab: int | None = None):
    d = dict(SHAPES[shape], num_hidden_layers=1, tie_word_embeddings=False)
    layer = ModelConfig.from_hf_dict(d)
    L = cfg.num_layers
    ecfg = EagleConfig(method="eagle3", layer=layer, target_vocab_size=cfg.vocab_size,
                       draft_vocab_size=draft_vocab or min(32000, cfg.vocab_size // 3),
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


def timed_engine(eng, call, steps):
    """Seconds per call of call() -> outputs, which advances eng.state (compiled and warmed first)."""
    for _ in range(2):
        out = call()
    jax.block_until_ready((out, eng.state))
    t0 = time.perf_counter()
    for _ in range(steps):
        out = call()
    jax.block_until_ready((out, eng.state))
    return (time.perf_counter() - t0) / steps, out


def bench_attention(cfg, impl, spec, batch, context, max_seq_len, page_size, steps, dtype=None):
    """(decode, verify) attention ms per step, all layers: `attend` alone with the step's shapes over
    one layer's pages, chained cfg.num_layers times inside one program (each call's output is the
    next one's query, so nothing is merged or skipped)."""
    from specjax import attention, tree as tree_lib
    from specjax.kv_cache import meta_at
    dtype = dtype or DTYPE
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


MESH = None  # set by --tensor-parallel N > 1: the engines place weights and state in their shardings
DTYPE = jnp.bfloat16


class _NoText:
    """The requests' tokenizer: the benchmark never reads their text."""

    def decode(self, ids, skip_special_tokens=True):
        return ""


ATTENTION: str | attention.AttnImpl = "auto"  # --attention / --interpret, as the engine takes it
KV_COMPACT = "auto"  # --kv-compact-impl


def make_engine(target, cfg, batch, max_seq_len, page_size, draft=None):
    eng = Engine(target, cfg, CacheOptions(page_size=page_size, max_seq_len=max_seq_len),
                 BatchOptions(max_batch=batch), DTYPE, draft=draft, mesh=MESH, kv_compact_impl=KV_COMPACT,
                 attention=ATTENTION)
    print("engine:", eng.info, flush=True)
    return eng


def admit(eng, cfg, batch, context, max_seq_len, temperature, steps):
    """`batch` requests of `context` random prompt tokens, prefilled by the engine (engine steps,
    which also dispatch their first steps), with KV pages for `steps` more steps of the programs.
    -> (slots, active, static flags) as the engine passes them."""
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=max_seq_len, temperature=temperature, top_p=0.9 if temperature else 1.0,
                            ignore_eos=True)
    reqs = [Request(i, None, rng.integers(0, cfg.vocab_size, context).tolist(), params, _NoText(), (), max_seq_len, i)
            for i in range(batch)]
    for r in reqs:
        eng.add_request(r)
    while (eng.sched.queue or len(eng.sched.decoding()) < batch) and not any(r.finished for r in reqs):
        eng.step()  # prefill, in chunks when batch * context > max_prefill_tokens
    rows = eng.sched.decoding()
    assert len(rows) == batch and not any(r.finished for r in reqs), [r.error for r in reqs]
    for s, _ in rows:
        eng.sched.inflight[s] += eng.sched.advance * (steps + 3)
    assert not eng.sched.reserve(), "--max-seq-len too short for --context and --steps"
    eng._push_page_table()
    # the rows the engine's dispatch pads to (a fused step of one request runs one row; plain runs >= 2)
    slots, active = eng.sched.row_slots(rows, min_rows=eng._min_rows("spec" if eng.draft is not None else "decode"))
    return reqs, slots, active, eng._flags(reqs)


def release(eng, reqs):
    for r in reqs:
        eng.cancel(r.id)
    while eng.has_unfinished():
        eng.step()


def bench_plain(target, cfg, batch, context, max_seq_len, page_size, steps, temperature):
    """(seconds per step with num_steps=1, with num_steps=8) of the engine's decode_many."""
    eng = make_engine(target, cfg, batch, max_seq_len, page_size)
    K = eng.batch_opts.steps_per_call
    reqs, slots, active, flags = admit(eng, cfg, batch, context, max_seq_len, temperature, (1 + K) * (steps + 2))

    def call(k):
        def run():
            out, _, eng.state = eng.steps.decode_many(eng.weights, eng.state, eng.samp, slots, active, None,
                                                      num_steps=k, **flags)
            return out
        return run

    one, _ = timed_engine(eng, call(1), steps)
    many, _ = timed_engine(eng, call(K), steps)
    release(eng, reqs)
    return one, many / K


def bench_spec(target, cfg, head, ecfg, spec, batch, context, max_seq_len, page_size, steps, temperature,
               breakdown=False):
    info = DraftInfo("eagle3", ecfg.aux_layers)
    eng = make_engine(target, cfg, batch, max_seq_len, page_size, Draft(head, ecfg.layer, info, spec))
    reqs, slots, active, flags = admit(eng, cfg, batch, context, max_seq_len, temperature,
                                       (3 if breakdown else 2) * (steps + 2) + 2)
    tw, dw = eng.weights, eng.draft_weights

    stop = prog.no_stop(len(slots))

    def fused_call():  # one fused step per dispatch (the engine runs up to spec_steps_per_call of them)
        out, _, eng.state = eng.spec_steps.step(tw, dw, eng.state, eng.samp, slots, active, None, stop,
                                                num_steps=1, **flags)
        return out

    fused, out = timed_engine(eng, fused_call, steps)
    tau = float(np.asarray(out.num_accepted)[0, :batch].mean())
    unf, parts = None, {}
    if temperature == 0:
        unf, parts = unfused(eng, target, head, info, spec, slots, active, steps, breakdown)
    release(eng, reqs)
    return fused, unf, tau, dict(parts, kv_compact=eng.kernels.kv_compact, engine=eng.info)


def unfused(eng, target, head, info, spec, slots, active, steps, breakdown):
    """Greedy: verify + accept (+ compaction) | host read | draft extend + next tree, as two jitted
    programs on the engine's state (donated to both; the first hands over the compacted cache)."""
    tgd, tp = nnx.split(target)
    dgd, dp = nnx.split(head)
    t_def, d_def = jax.tree.structure(tp), jax.tree.structure(dp)
    tw, dw = eng.weights, eng.draft_weights

    def part1(tw, s):
        ver = step.verify_forward(info, spec, nnx.merge(tgd, jax.tree.unflatten(t_def, tw)), s, slots, active)
        acc = step.accept(spec, s, ver, slots, active, None, False, False, kernels=eng.kernels)
        return (ver.h, ver.aux, acc.out, acc.accept_idx, acc.bonus), dataclasses.replace(s, cache=acc.cache)

    def part2(tw, dw, s, h, aux, out, idx, bonus):
        ver = step.Verified(logits=None, h=h, aux=aux, cache=None)
        acc = step.Accepted(out=out, accept_idx=idx, bonus=bonus, cache=s.cache)
        return step.draft_next(info, spec, nnx.merge(tgd, jax.tree.unflatten(t_def, tw)),
                               nnx.merge(dgd, jax.tree.unflatten(d_def, dw)), s, ver, acc, slots, active,
                               None, False)

    p1 = jax.jit(part1, donate_argnums=(1,))
    p2 = jax.jit(part2, donate_argnums=(2,))

    def unfused_step(s):
        mid, s = p1(tw, s)
        np.asarray(mid[2].tokens)  # the host reads the accepted tokens before drafting
        return mid[2], p2(tw, dw, s, *mid)

    unf, eng.state = timed(unfused_step, eng.state, steps)
    parts = {}
    if breakdown:  # each part alone, repeatedly on the same inputs
        state = eng.state
        fwd = jax.jit(lambda tw, s: step.verify_forward(info, spec, nnx.merge(tgd, jax.tree.unflatten(t_def, tw)),
                                                        s, slots, active).logits)
        parts["target_fwd_ms"] = timed(lambda s: (fwd(tw, s), s), state, steps)[0] * 1e3
        p1n = jax.jit(part1)
        parts["verify_accept_ms"] = timed(lambda s: (p1n(tw, s)[0][2].tokens, s), state, steps)[0] * 1e3
        mid, state = p1(tw, state)
        p2n = jax.jit(part2)
        parts["draft_ms"] = timed(lambda s: (p2n(tw, dw, s, *mid).draft_seq_lens, s), state, steps)[0] * 1e3
        eng.state = state
    return unf, parts


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
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="the random head's draft vocabulary (default: min(32000, vocab / 3))")
    p.add_argument("--tensor-parallel", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--sampling", default="greedy,sample", help="greedy and/or sample (temperature 0.7)")
    p.add_argument("--kv-compact-impl", default="auto", choices=kernels.KV_COMPACT_CHOICES)
    p.add_argument("--attention", default="auto", help="implementation at specjax.attention (resolve)")
    p.add_argument("--interpret", action="store_true", help="run a Pallas kernel in its interpreter (CPU)")
    a = p.parse_args()
    global MESH, DTYPE, ATTENTION, KV_COMPACT
    DTYPE = jnp.bfloat16 if a.dtype == "bfloat16" else jnp.float32
    KV_COMPACT = a.kv_compact_impl
    if a.tensor_parallel > 1:
        from specjax import sharding
        MESH = sharding.make_mesh(a.tensor_parallel)
    temps = {"greedy": 0.0, "sample": 0.7}
    modes = a.sampling.split(",")
    if not modes or set(modes) - set(temps):
        p.error(f"--sampling: choose from {sorted(temps)}")
    print("device:", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    rows = []
    for shape in a.shapes.split(","):
        cfg = shape_config(shape)
        target = Llama(cfg, DTYPE, nnx.Rngs(0))
        head, ecfg = eagle3_head(shape, cfg, DTYPE, a.draft_vocab)
        # the attention the engine will choose (it resolves the same request again); the models are
        # configured with it here too, for the unfused variant and the attention-alone timings
        pick = dict(dtype=DTYPE, page_size=a.page_size, interpret=a.interpret, mesh=MESH)
        impl, choice = attention.resolve(a.attention, head_dim=cfg.head_dim, **pick)
        ATTENTION = attention.AttnImpl(impl.name, interpret=True) if a.interpret else a.attention
        target = attention.configure(target, impl)
        head = attention.configure(head, attention.resolve(a.attention, head_dim=ecfg.layer.head_dim, **pick)[0])
        print(choice, flush=True)
        for b in map(int, a.batches.split(",")):
            for mode in modes:
                plain, plain_k8 = bench_plain(target, cfg, b, a.context, a.max_seq_len, a.page_size, a.steps,
                                              temps[mode])
                for name in a.configs.split(","):
                    spec = parse_config(name)
                    fused, unf, tau, parts = bench_spec(target, cfg, head, ecfg, spec, b, a.context, a.max_seq_len,
                                                        a.page_size, a.steps, temps[mode], a.breakdown)
                    if MESH is None and mode == modes[0]:
                        dec, ver = bench_attention(cfg, impl, spec, b, a.context, a.max_seq_len, a.page_size,
                                                   a.steps)
                        parts.update(decode_attn_ms=dec, verify_attn_ms=ver, verify_over_decode_attn=ver / dec)
                    r = dict(shape=shape, tp=a.tensor_parallel, batch=b, config=name, sampling=mode,
                             num_steps=spec.num_steps, topk=spec.topk, num_draft_tokens=spec.num_draft_tokens,
                             plain_ms=plain * 1e3, plain_k8_ms=plain_k8 * 1e3, fused_ms=fused * 1e3,
                             unfused_ms=None if unf is None else unf * 1e3, ratio=fused / plain,
                             random_head_tau=tau, **parts)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    print("| shape | TP | batch | config | sampling | plain ms | plain ms (K=8) | fused ms | unfused ms | fused/plain "
          "| decode attn ms | verify attn ms | verify/decode attn |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        unf = "-" if r["unfused_ms"] is None else f"{r['unfused_ms']:.3f}"
        attn = (f"{r['decode_attn_ms']:.3f} | {r['verify_attn_ms']:.3f} | {r['verify_over_decode_attn']:.2f}"
                if "decode_attn_ms" in r else "- | - | -")
        print(f"| {r['shape']} | {r['tp']} | {r['batch']} | {r['config']} | {r['sampling']} | {r['plain_ms']:.3f} "
              f"| {r['plain_k8_ms']:.3f} | {r['fused_ms']:.3f} | {unf} | {r['ratio']:.2f} | {attn} |")


if __name__ == "__main__":
    main()
