"""What a device DFA (specjax.device_dfa) adds to a program: the mask and node-state ops alone, and
the engine's fused speculative program with and without a DFA row, old ops against new.

    python scripts/bench_dfa_mask.py                       # GPU: SmolLM2-135M shape + EAGLE-3 head, B = 1, 32
    python scripts/bench_dfa_mask.py --dtype float32 --iters 3 --batches 1,32   # CPU (slow: minutes)
    python scripts/bench_dfa_mask.py --shape tiny --dtype float32 --iters 2 --batches 2 --nodes 1,5 \\
        --vocab 512 --draft-vocab 170                      # CPU smoke run

Random tables and weights; every figure is the median of --iters timed calls (jit, compiled and
warmed first, each call blocked on), in ms; the variants of a cell are timed round-robin.

ops (one program per cell; logits [B, K, V] float32 as the target's verify returns them, a DFA
state per node, tables of --states x --classes per slot):
  argmax     jnp.argmax over V alone: what greedy verification does without a DFA
  gather     device_dfa.mask_logits_reference then argmax: the old mask (one gather per
             (row, node, token) from the allowed classes [B, K, C], index broadcast over K)
  packed     device_dfa.mask_logits then argmax: the nodes' allowed classes packed in words
             [B, ceil(K/32), C], one gather per (row, token), node k's bit taken out elementwise
  flat       a candidate not in the library: one gather per (row, node, token) straight from the
             table next (flat index), no allowed-class rows, no index broadcast, no transpose
  bitrows    a candidate not in the library: per-slot per-state allowed-token bit rows
             [M, S, V/32] uint32 precomputed (their size printed), a row gather per node
  *_alone    the masked logits written out (no consumer), for the sampling paths
  K = 1 is plain decoding's (and a chain draft depth's) mask, K = num_steps + 1 a chain's
  verify; rows with V = --draft-vocab show what masking EAGLE-3 drafts in the draft vocabulary
  costs (EAGLE-3 heads draft under the DFA in their own vocabulary: draft_tree.draft_vocab_view).
tree_states: the DFA state of each node of a chain / random tree of K nodes: the old node-by-node
  device loop (tree_states_reference) and the new unrolled relaxation over the depth (tree_states).

program (--no-program to skip): the engine's fused speculative program (programs.spec_programs
`step`, --steps-per-call fused steps per dispatch, greedy), on an Engine holding B requests of
--context random tokens, with random bf16 (--dtype) weights of --shape and a random EAGLE-3 head
(draft vocabulary V/3 = 16384 for SmolLM2), chain of --num-steps, every row under a permissive DFA
(8 states, 14 classes, like `[\\s\\S]*` over SmolLM2's vocabulary) where the variant has one:
  none           dfa=False, no DFA tables in the state (an engine before its first DFA request:
                 bench_engine's unconstrained baseline); the ratios x are over it
  off            dfa=False with the tables in the state (a batch without DFA rows after one)
  old            dfa=True traced with the old ops (mask_logits_reference, tree_states_reference)
  new            dfa=True with the library's ops (the engine's own program)
  new_mask_only  the new mask with the old tree_states; new_tree_only the other way round
  flat           the candidate flat-gather mask with the new tree_states
  bitrows        the candidate bit-row mask (a program constant here, of the DFA's 8 states) with the
                 new tree_states
Variants other than the engine's own run the same function under a new identity, traced with their
ops (the row's *_hlo: while loops / gathers of each traced program). Each timed call starts from
the same state (lengths, trees, DFA states rewound), so the variants see the same shapes and
lengths, and the variants are timed round-robin (a busy machine slows all alike). --hlo-dir writes
each variant's compiled HLO (e.g. to compare `none` and `new` fusion by fusion). On the CPU the
figures rank the variants at best (XLA CPU fuses differently); the GPU figures are the ones that
answer issue 15 (bench_engine: spec any dfa vs spec fused at B = 32).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specjax import device_dfa as dfa_lib  # noqa: E402


def median_ms(fn, *args, iters: int, warmup: int = 2, before=None) -> float:
    """Median over iters calls of fn(*args) (compiled and warmed first), each blocked on, in ms.
    before(): run untimed before each call (e.g. rewinding a donated state); may return new args."""
    for _ in range(warmup):
        args = before() if before else args
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        args = before() if before else args
        jax.block_until_ready(args)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def round_robin(cells: dict, iters: int) -> dict:
    """{name: (fn, args)} -> {name: median ms}: each warmed, then timed once per round, round after
    round (a busy machine slows every cell alike)."""
    times = {n: [] for n in cells}
    for n, (fn, args) in cells.items():
        median_ms(fn, *args, iters=1)
    for _ in range(iters):
        for n, (fn, args) in cells.items():
            times[n].append(median_ms(fn, *args, iters=1, warmup=0))
    return {n: float(np.median(t)) for n, t in times.items()}


PERMISSIVE_STATES = 8  # states of the permissive DFA (random_tables)


def random_tables(M, V, S, C, seed=0, permissive=False):
    """DFATables of M slots with random class maps and transitions (state 0 everywhere); permissive:
    8 states, 14 classes (the size of `[\\s\\S]*` over SmolLM2's vocabulary), every move allowed but
    class 13 outside state 0, so random tokens rarely leave the DFA."""
    rng = np.random.default_rng(seed)
    if permissive:
        ns, nc = min(PERMISSIVE_STATES, S), min(14, C)
        cls = np.broadcast_to(np.arange(V) % nc, (M, V))
        nxt = np.full((M, S, C), -1, np.int32)
        s, c = np.meshgrid(np.arange(ns), np.arange(nc), indexing="ij")
        nxt[:, :ns, :nc] = np.where((c == nc - 1) & (s > 0), -1, (s * 7 + c) % ns)
    else:
        cls = rng.integers(0, C, (M, V))
        nxt = rng.integers(-1, S, (M, S, C)).astype(np.int32)
    t = dfa_lib.init_tables(M, V, S, C)
    return dfa_lib.admit(t, jnp.arange(M, dtype=jnp.int32), jnp.asarray(cls), jnp.asarray(nxt),
                         jnp.zeros((M,), jnp.int32))


def bit_rows(t: dfa_lib.DFATables):
    """Candidate tables: [M, S, V / 32] uint32, bit v % 32 of word v // 32 set where state s allows
    token v."""
    V = t.cls.shape[1]
    bit = jnp.left_shift(jnp.uint32(1), jnp.arange(32, dtype=jnp.uint32))

    def one(slot):  # [S, V / 32] of one slot
        cls, nxt = slot
        ok = nxt[:, cls.astype(jnp.int32)] >= 0  # [S, V]
        ok = jnp.pad(ok, ((0, 0), (0, -V % 32))).reshape(ok.shape[0], -1, 32)
        return jnp.sum(jnp.where(ok, bit, jnp.uint32(0)), axis=-1, dtype=jnp.uint32)

    return jax.jit(lambda c, n: jax.lax.map(one, (c, n)))(t.cls, t.next)


def mask_bitrows(logits, rows, slots, states):
    """logits [B, K, V] masked through the candidate bit rows [M, S, W] of the slots [B]."""
    B, K, V = logits.shape
    w = rows[slots[:, None], jnp.clip(states, 0, rows.shape[1] - 1)]  # [B, K, W]
    bits = (jnp.right_shift(w[..., None], jnp.arange(32, dtype=jnp.uint32)) & 1).reshape(B, K, -1)[..., :V]
    allowed = (bits != 0) | (states < 0)[..., None]
    return jnp.where(allowed, logits, -jnp.inf)


def mask_flat(logits, v, states=None):
    """A candidate mask_logits: one gather per (row, node, token) straight from the table next
    (flat index (slot * S + state) * C + cls[token]: no allowed-class rows, no index broadcast)."""
    if v is None:
        return logits
    states = v.state if states is None else states
    B, V = logits.shape[0], logits.shape[-1]
    S, C = v.next.shape[1:]
    flat = states.reshape(B, -1)  # [B, K]
    row = (v.slots[:, None] * S + jnp.clip(flat, 0, S - 1)) * C  # [B, K]
    cls = v.cls[v.slots].astype(jnp.int32)  # [B, V]
    ok = v.next.reshape(-1).at[row[:, :, None] + cls[:, None, :]].get(mode="promise_in_bounds") >= 0
    allowed = (ok | (flat < 0)[:, :, None]).reshape(logits.shape)
    return jnp.where(allowed, logits, jnp.asarray(-jnp.inf, logits.dtype))


def bench_ops(batches, nodes, vocabs, S, C, iters):
    rows = []
    for V in vocabs:
        M = max(batches)
        t = random_tables(M, V, S, C)
        br = bit_rows(t)
        for B in batches:
            slots = jnp.arange(B, dtype=jnp.int32) % M
            v = dfa_lib.view(t, slots)
            for K in nodes:
                rng = np.random.default_rng(K)
                states = jnp.asarray(rng.integers(-1, S, (B, K)), jnp.int32)
                logits = jnp.asarray(rng.normal(size=(B, K, V)), jnp.float32)
                am = jax.jit(lambda lg: jnp.argmax(lg, -1))
                old = jax.jit(lambda lg, v, s: jnp.argmax(dfa_lib.mask_logits_reference(lg, v, s), -1))
                new = jax.jit(lambda lg, v, s: jnp.argmax(dfa_lib.mask_logits(lg, v, s), -1))
                flat = jax.jit(lambda lg, v, s: jnp.argmax(mask_flat(lg, v, s), -1))
                cand = jax.jit(lambda lg, r, sl, s: jnp.argmax(mask_bitrows(lg, r, sl, s), -1))
                old_a = jax.jit(dfa_lib.mask_logits_reference)
                new_a = jax.jit(dfa_lib.mask_logits)
                assert np.array_equal(np.asarray(old(logits, v, states)), np.asarray(new(logits, v, states)))
                assert np.array_equal(np.asarray(old(logits, v, states)), np.asarray(cand(logits, br, slots, states)))
                assert np.array_equal(np.asarray(old(logits, v, states)), np.asarray(flat(logits, v, states)))
                cells = dict(argmax=(am, (logits,)), gather=(old, (logits, v, states)),
                             packed=(new, (logits, v, states)), flat=(flat, (logits, v, states)),
                             bitrows=(cand, (logits, br, slots, states)), gather_alone=(old_a, (logits, v, states)),
                             packed_alone=(new_a, (logits, v, states)))
                r = dict(part="ops", batch=B, nodes=K, vocab=V,
                         **{f"{n}_ms": ms for n, ms in round_robin(cells, iters).items()},
                         bitrows_mib_per_slot=br[0].nbytes / 2 ** 20)
                rows.append(r)
                print(json.dumps(r), flush=True)
    return rows


def chain_or_tree(B, N, rng):
    """parents [B, N] of a chain when N <= 6, else of random trees of depth <= 5 (EAGLE-2's); and the depth bound."""
    if N <= 6:
        return np.tile(np.arange(-1, N - 1), (B, 1)), N - 1
    par = np.full((B, N), -1)
    depth = np.zeros((B, N), int)
    for i in range(1, N):
        par[:, i] = rng.integers(0, i, B)
        while True:  # parents of depth < 5 only
            bad = depth[np.arange(B), par[:, i]] >= 5
            if not bad.any():
                break
            par[bad, i] = rng.integers(0, i, bad.sum())
        depth[:, i] = depth[np.arange(B), par[:, i]] + 1
    return par, int(depth.max())


def bench_tree_states(batches, nodes, V, S, C, iters):
    rows = []
    t = random_tables(max(batches), V, S, C, permissive=True)
    for B in batches:
        v = dfa_lib.view(t, jnp.arange(B, dtype=jnp.int32) % max(batches))
        for N in sorted({max(n, 2) for n in nodes}):
            rng = np.random.default_rng(N)
            par, depth = chain_or_tree(B, N, rng)
            par = jnp.asarray(par, jnp.int32)
            toks = jnp.asarray(rng.integers(0, V, (B, N)), jnp.int32)
            old = jax.jit(dfa_lib.tree_states_reference)
            new = jax.jit(dfa_lib.tree_states, static_argnames=("max_depth",))
            assert np.array_equal(np.asarray(old(v, toks, par)), np.asarray(new(v, toks, par, max_depth=depth)))
            ms = round_robin(dict(loop=(old, (v, toks, par)),
                                  unrolled=(lambda *a: new(*a, max_depth=depth), (v, toks, par))), iters)
            r = dict(part="tree_states", batch=B, nodes=N, max_depth=depth, loop_ms=ms["loop"],
                     unrolled_ms=ms["unrolled"])
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


@contextlib.contextmanager
def dfa_ops(mask, tree):
    """Trace programs with other device-DFA ops (mask_logits, tree_states); the library's restored after."""
    saved = dfa_lib.mask_logits, dfa_lib.tree_states
    dfa_lib.mask_logits, dfa_lib.tree_states = mask, tree
    try:
        yield
    finally:
        dfa_lib.mask_logits, dfa_lib.tree_states = saved


def bitrows_mask_logits(rows):
    """A mask_logits through the candidate bit rows [M, S, W] (closed over: a constant of the program)."""
    def mask(logits, v, states=None):
        if v is None:
            return logits
        states = v.state if states is None else states
        B, V = logits.shape[0], logits.shape[-1]
        flat = states.reshape(B, -1)
        out = mask_bitrows(logits.reshape(B, flat.shape[1], V), rows, v.slots, flat)
        return out.reshape(logits.shape)
    return mask


# program variants: (name, dfa flag, (mask_logits, tree_states) to trace with; None: the library's);
# "none": no DFA tables in the state at all (bench_engine's unconstrained baseline)
VARIANTS = (("none", False, None), ("off", False, None), ("old", True, "ref,ref"), ("new", True, None),
            ("new_mask_only", True, "new,ref"), ("new_tree_only", True, "ref,new"), ("flat", True, "flat,new"),
            ("bitrows", True, "bitrows,new"))


def bench_program(a, batches):
    import bench_spec as bs
    from flax import nnx
    from specjax import programs as prog
    from specjax.drafter import DraftInfo
    from specjax.engine import Draft
    from specjax.models.llama import Llama
    from specjax.shapes import shape_config
    from specjax.tree import SpecConfig
    bs.DTYPE = jnp.bfloat16 if a.dtype == "bfloat16" else jnp.float32
    bs.ATTENTION = a.attention
    cfg = shape_config(a.shape)
    target = Llama(cfg, bs.DTYPE, nnx.Rngs(0))
    head, ecfg = bs.eagle3_head(a.shape, cfg, bs.DTYPE)
    spec = SpecConfig(method="eagle3", num_steps=a.num_steps, topk=1)
    info = DraftInfo("eagle3", ecfg.aux_layers)
    K = a.steps_per_call
    wanted = a.variants.split(",")
    rows = []
    for B in batches:
        eng = bs.make_engine(target, cfg, B, a.max_seq_len, a.page_size, Draft(head, ecfg.layer, info, spec))
        reqs, slots, active, flags = bs.admit(eng, cfg, B, a.context, a.max_seq_len, 0.0, K + 2)
        M = eng.batch_opts.max_batch
        t = random_tables(M, cfg.vocab_size, a.states, a.classes, permissive=True)
        eng.state = dataclasses.replace(eng.state, dfa=eng._commit(t))
        st0 = eng.state
        snap = jax.tree.map(jnp.copy, (st0.cache.seq_lens, st0.draft_seq_lens, st0.tree, st0.dfa))
        stop = prog.no_stop(len(slots))
        tw, dw = eng.weights, eng.draft_weights
        fused = eng.spec_steps.step.__wrapped__
        statics = ("num_steps", "lite", "want_logprobs", "stochastic", "dfa")
        impls = dict(ref=(dfa_lib.mask_logits_reference, dfa_lib.tree_states_reference),
                     new=(dfa_lib.mask_logits, dfa_lib.tree_states), flat=(mask_flat, None))
        if "bitrows" in wanted:
            # the rows of the states the permissive DFA has (a program constant: the full [M, S, W] table
            # would be one of M * S * V / 8 bytes; the per-step work does not depend on S)
            impls["bitrows"] = (bitrows_mask_logits(bit_rows(t)[:, :PERMISSIVE_STATES]), None)

        def rewind(tables=True):  # tables False: the state without DFA tables
            s = eng.state
            sl, dsl, tree, dfa = jax.tree.map(jnp.copy, snap)  # (the state's arrays are donated)
            eng.state = dataclasses.replace(s, cache=dataclasses.replace(s.cache, seq_lens=sl), draft_seq_lens=dsl,
                                            tree=tree, dfa=dfa if tables else None)
            return ()

        def call(step, dfa):
            def run():
                out, _, eng.state = step(tw, dw, eng.state, eng.samp, slots, active, None, stop, num_steps=K,
                                         **dict(flags, dfa=dfa))
                return out
            return run

        r = dict(part="program", batch=B, shape=a.shape, dtype=a.dtype, num_steps=a.num_steps, steps_per_call=K,
                 device=jax.devices()[0].device_kind)
        runs = {}  # name -> (run, dfa, how): compiled and warmed, then timed round-robin
        for name, dfa, how in VARIANTS:
            if name not in wanted:
                continue
            step = eng.spec_steps.step
            ctx = contextlib.nullcontext()
            if how is not None:  # the engine's function under a new identity (jit caches are keyed by the
                m, tr = how.split(",")  # function: jit(fused) would share the engine's), traced by its first call

                def fresh(*args, **kw):
                    return fused(*args, **kw)
                step = jax.jit(fresh, donate_argnums=(2,), static_argnames=statics)
                ctx = dfa_ops(impls[m][0], impls[tr][1])
            before = functools.partial(rewind, name != "none")
            with ctx:
                for _ in range(2):
                    before()
                    jax.block_until_ready(call(step, dfa)())
                low = step.lower(tw, dw, eng.state, eng.samp, slots, active, None, stop, num_steps=K,
                                 **dict(flags, dfa=dfa))  # the traced program (cached trace)
                txt = low.as_text()
                if a.hlo_dir:  # the optimised program, to read what XLA made of it (compiles it again)
                    Path(a.hlo_dir).mkdir(parents=True, exist_ok=True)
                    (Path(a.hlo_dir) / f"{name}_B{B}.hlo.txt").write_text(low.compile().as_text())
            r[f"{name}_hlo"] = f"{txt.count('stablehlo.while')} while / {txt.count('stablehlo.gather')} gather"
            runs[name] = (step, call(step, dfa), before)
        times = {name: [] for name in runs}
        for _ in range(a.iters):  # round-robin: a busy machine slows every variant alike
            for name, (_, run, before) in runs.items():
                times[name].append(median_ms(run, iters=1, warmup=0, before=before))
        for name, (step, _, _) in runs.items():
            r[f"{name}_ms"] = float(np.median(times[name]))
            if step is not eng.spec_steps.step:
                assert step._cache_size() == 1, f"{name}: traced again (with the library's ops)"
        r["base"] = base = "none" if "none_ms" in r else "off"
        for name, _, _ in VARIANTS:
            if f"{name}_ms" in r and name != base and f"{base}_ms" in r:
                r[f"{name}_x"] = r[f"{name}_ms"] / r[f"{base}_ms"]
        rows.append(r)
        print(json.dumps(r), flush=True)
        bs.release(eng, reqs)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--nodes", default="1,5,17", help="comma list K: nodes masked per row (1 plain, 5 chain of 4)")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--draft-vocab", type=int, default=16384, help="0: no draft-vocabulary rows")
    from specjax.scheduler import SchedulerOptions
    p.add_argument("--states", type=int, default=SchedulerOptions.dfa_max_states,
                   help="S_max (default: the engine's, SchedulerOptions.dfa_max_states)")
    p.add_argument("--classes", type=int, default=SchedulerOptions.dfa_max_classes,
                   help="C_max (default: the engine's, SchedulerOptions.dfa_max_classes)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--no-ops", action="store_true")
    p.add_argument("--no-program", action="store_true")
    p.add_argument("--shape", default="smollm2-135m", help="program: model shape (specjax.shapes)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--num-steps", type=int, default=4, help="program: chain length (bench_engine's 4)")
    p.add_argument("--steps-per-call", type=int, default=4, help="program: fused steps per dispatch (engine's 4)")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--attention", default="auto")
    p.add_argument("--variants", default=",".join(v[0] for v in VARIANTS),
                   help="program variants to time (comma list)")
    p.add_argument("--hlo-dir", help="program: write each variant's compiled HLO here ({variant}_B{B}.hlo.txt)")
    p.add_argument("--json", help="append the rows as JSON lines to this file")
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    nodes = [int(k) for k in a.nodes.split(",")]
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
    rows = []
    if not a.no_ops:
        vocabs = [a.vocab] + ([a.draft_vocab] if a.draft_vocab else [])
        rows += bench_ops(batches, nodes, vocabs, a.states, a.classes, a.iters)
        rows += bench_tree_states(batches, nodes, a.vocab, a.states, a.classes, a.iters)
    if not a.no_program:
        rows += bench_program(a, batches)
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    ops = [r for r in rows if r["part"] == "ops"]
    if ops:
        print(f"\nmask + argmax over V (ms; median of {a.iters})\n{'B':>3} {'K':>3} {'V':>6} {'argmax':>8} "
              f"{'gather':>8} {'packed':>8} {'flat':>8} {'bitrows':>8} {'gather/alone':>13} {'packed/alone':>13} "
              f"{'bitrows MiB/slot':>17}")
        for r in ops:
            print(f"{r['batch']:>3} {r['nodes']:>3} {r['vocab']:>6} {r['argmax_ms']:>8.3f} {r['gather_ms']:>8.3f} "
                  f"{r['packed_ms']:>8.3f} {r['flat_ms']:>8.3f} {r['bitrows_ms']:>8.3f} {r['gather_alone_ms']:>13.3f} "
                  f"{r['packed_alone_ms']:>13.3f} {r['bitrows_mib_per_slot']:>17.2f}")
    ts = [r for r in rows if r["part"] == "tree_states"]
    if ts:
        print(f"\ntree_states (ms)\n{'B':>3} {'N':>3} {'depth':>5} {'loop':>8} {'unrolled':>9}")
        for r in ts:
            print(f"{r['batch']:>3} {r['nodes']:>3} {r['max_depth']:>5} {r['loop_ms']:>8.3f} {r['unrolled_ms']:>9.3f}")
    pr = [r for r in rows if r["part"] == "program"]
    if pr:
        names = [v[0] for v in VARIANTS if f"{v[0]}_ms" in pr[0]]
        print(f"\nfused speculative program, {pr[0]['steps_per_call']} steps per dispatch (ms per dispatch; "
              f"x: over {pr[0]['base']})\n{'B':>3} " + " ".join(f"{n:>15}" for n in names))
        for r in pr:
            cells = [f"{r[n + '_ms']:8.3f}" + (f" {r[n + '_x']:5.3f}x" if n + "_x" in r else " " * 7)
                     for n in names]
            print(f"{r['batch']:>3} " + " ".join(f"{c:>15}" for c in cells))
        print("StableHLO ops of each variant (B = %d): " % pr[0]["batch"]
              + "; ".join(f"{n} {pr[0][n + '_hlo']}" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
