"""Session 45: bisect the one-slot engine's defect on a GPU (float32).

Archived as run: it needs scripts/check_lossless.py of 039e047 (variant "old_spare"; since 9550203 every
speculative engine has two device slots, so "old" no longer has one). Run it from a checkout of 039e047.

Runs the `old` engine (one slot, synchronous) on one prompt, capturing the state after the first prefill
and the first fused dispatch's arguments; then replays that first dispatch in several ways:
  fused K=4 / K=1 (the engine's program), progs.verify (argmax at each node), jit(spec_step), eager
  spec_step, each on the one-slot state and on the same state padded to two slots, and on the CPU.
Also the same capture from `old_spare` (two slots) to compare the states after prefill (KV of the prompt).
"""
from __future__ import annotations
import dataclasses, json, sys, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "scripts"))
import jax, jax.numpy as jnp, numpy as np

MODEL = sys.argv[1]
DRAFT = str(ROOT / "specjax/assets/eagle3-smollm2-135m")
import check_lossless as cl
from specjax import programs as prog, step as step_lib, tree as tree_lib
from specjax.kv_cache import meta_at
from specjax.sampling_params import SamplingParams

SP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = "Write a short note number 0 about the weather, the sea and the mountains."
t0 = time.time()


def log(*a):
    print(f"[{time.time() - t0:6.1f}s]", *a, flush=True)


def capture(v):
    cap = {}
    orig_sp = prog.spec_programs

    def sp(*a, **k):
        cap["sp"] = (a, k)
        return orig_sp(*a, **k)
    prog.spec_programs = sp
    try:
        llm = cl.variant_llm(v, MODEL, DRAFT, "float32", True)
    finally:
        prog.spec_programs = orig_sp
    eng = llm.engine
    progs = eng.spec_steps

    def prefill(*a, **k):
        r = progs.prefill(*a, **k)
        if "state" not in cap:
            cap["state"] = jax.device_get(r[2]); cap["samp_all"] = jax.device_get(r[3])
        return r

    def step(*a, **k):
        if "args" not in cap:
            cap["tw"], cap["dw"] = a[0], a[1]
            cap["args"] = jax.device_get(tuple(a[3:])); cap["kw"] = dict(k)
        r = progs.step(*a, **k)
        if "out1" not in cap:
            cap["out1"] = np.asarray(r[0].tokens).tolist()
        return r
    eng.spec_steps = progs._replace(prefill=prefill, step=step)
    toks = [list(map(int, o.token_ids)) for o in llm.generate([PROMPT], SP)]
    cap["tokens"] = toks
    cap["progs"] = progs
    cap["eng"] = eng
    log(v, "tokens", toks, "first fused out", cap["out1"], "kw", cap["kw"])
    return cap


from specjax.llm import LLM
plain = [list(map(int, o.token_ids)) for o in LLM(model=MODEL, dtype="float32", max_batch=1).generate([PROMPT], SP)]
log("plain", plain)
c1 = capture("old")
c2 = capture("old_spare")

# 1. the states after the first prefill: slot 0's arrays and the KV of its pages
s1, s2 = c1["state"], c2["state"]
pt = np.asarray(s1.cache.page_table[0]); L = int(s1.cache.seq_lens[0]); ps = s1.cache.kv[0].shape[1]
pages = pt[: -(-L // ps)]
log("slot0 pages", pt[:6].tolist(), "L", L, "page_size", ps, "spare pages", np.asarray(s2.cache.page_table[0][:6]).tolist())
pt2 = np.asarray(s2.cache.page_table[0])[: -(-L // ps)]


def flat_kv(kv, pgs, n):
    return np.stack([np.asarray(k)[pgs].reshape(-1, *np.asarray(k).shape[2:])[:n] for k in kv])


for name in ("kv",):
    a, b = flat_kv(s1.cache.kv, pages, L), flat_kv(s2.cache.kv, pt2, L)
    d = np.abs(a - b)
    log("target KV of the prompt: max diff", float(d.max()), "per position max", d.reshape(d.shape[0], L, -1).max(axis=(0, 2)).tolist())
if s1.draft_kv:
    Ld = int(s1.draft_seq_lens[0])
    a, b = flat_kv(s1.draft_kv, pages, Ld), flat_kv(s2.draft_kv, pt2, Ld)
    d = np.abs(a - b)
    log("draft KV: Ld", Ld, "max diff", float(d.max()), "per position", d.reshape(d.shape[0], Ld, -1).max(axis=(0, 2)).tolist())
for f in ("draft_seq_lens", "tree_tokens", "tree_parents", "tree_depth", "done", "history"):
    x1, x2 = getattr(s1, f), getattr(s2, f)
    if x1 is not None:
        log(f, "1slot", np.atleast_1d(np.asarray(x1)[0])[:10].tolist(), "spare", np.atleast_1d(np.asarray(x2)[0])[:10].tolist())
# the trash page / other pages written?
for l in (0,):
    k1 = np.asarray(s1.cache.kv[l]); nz = [int(p) for p in range(k1.shape[0]) if np.abs(k1[p]).max() > 0]
    log("layer0 pages with nonzero KV (1 slot):", nz[:20])
    k2 = np.asarray(s2.cache.kv[l]); nz2 = [int(p) for p in range(k2.shape[0]) if np.abs(k2[p]).max() > 0]
    log("layer0 pages with nonzero KV (spare):", nz2[:20])

# 2. replays of the first dispatch on the one-slot state
progs, tw, dw = c1["progs"], c1["tw"], c1["dw"]
samp_all, slots, active, mask, stop, drafts = c1["args"][:6]
kw = c1["kw"]
log("dispatch args: slots", np.asarray(slots).tolist(), "active", np.asarray(active).tolist(), "stop", jax.tree.map(lambda x: np.asarray(x).tolist(), stop))


def pad2(state, samp):
    def p(x, zero=False):
        if x is None:
            return None
        x = np.asarray(x)
        extra = np.zeros_like(x[:1]) if zero else x[:1]
        return np.concatenate([x, extra], 0)
    c = state.cache
    cache = dataclasses.replace(c, page_table=p(c.page_table, True), seq_lens=p(c.seq_lens, True))
    st = dataclasses.replace(state, cache=cache, draft_seq_lens=p(state.draft_seq_lens, True),
                             tree_tokens=p(state.tree_tokens), tree_parents=p(state.tree_parents),
                             tree_depth=p(state.tree_depth), draft_probs=p(state.draft_probs),
                             history=p(state.history), done=p(state.done))
    assert state.penalties is None and state.dfa is None
    return st, jax.tree.map(lambda x: p(x), samp)


def fused(state, samp, K, dev=None):
    put = (lambda t: jax.device_put(t, dev)) if dev is not None else jax.device_put
    k = dict(kw, num_steps=K)
    r = progs.step(put(tw), put(dw), put(state), put(samp), put(slots), put(active), mask, put(stop), drafts, **k)
    return np.asarray(r[0].tokens)[:, 0].tolist()


def verify_argmax(state, dev=None):
    put = (lambda t: jax.device_put(t, dev)) if dev is not None else jax.device_put
    (logits, h, aux), _ = progs.verify(put(tw), put(state), put(slots), put(active))
    return np.asarray(jnp.argmax(logits, -1))[0].tolist()


st1, sa1 = s1, c1["samp_all"]
st2, sa2 = pad2(s1, sa1)
log("tree of the first step", np.asarray(s1.tree_tokens)[0][:8].tolist())
for name, fn in [
    ("fused K=4, 1 slot", lambda: fused(st1, sa1, 4)),
    ("fused K=1, 1 slot", lambda: fused(st1, sa1, 1)),
    ("verify argmax, 1 slot", lambda: verify_argmax(st1)),
    ("fused K=4, padded to 2 slots", lambda: fused(st2, sa2, 4)),
    ("fused K=1, padded", lambda: fused(st2, sa2, 1)),
    ("verify argmax, padded", lambda: verify_argmax(st2)),
    ("fused K=4, 1 slot, CPU", lambda: fused(st1, sa1, 4, jax.devices("cpu")[0])),
    ("verify argmax, 1 slot, CPU", lambda: verify_argmax(st1, jax.devices("cpu")[0])),
    ("spare state: fused K=4 (2 slots from the engine)", lambda: fused(s2, c2["samp_all"], 4)),
]:
    try:
        log("REPLAY", name, "->", fn())
    except Exception as e:  # noqa: BLE001
        log("REPLAY", name, "FAILED", type(e).__name__, str(e)[:300])

# 3. the verify's pieces, jitted and eager, on the one-slot state
a, k = c1["sp"]
info, spec, tgd, tparams, dgd, dparams = a[:6]
from flax import nnx
target = nnx.merge(tgd, tparams)


def pieces(state):
    rs, act = step_lib.live_rows(state, slots, active)
    N = spec.num_nodes
    Lr = state.cache.seq_lens[rs]
    tree = tree_lib.make_tree(state.tree_tokens[rs], state.tree_parents[rs], state.tree_depth[rs], spec.num_steps)
    meta = meta_at(state.cache.page_table[rs], Lr, act.astype(jnp.int32) * N, N, state.cache.page_size,
                   block_mask=tree.mask)
    return dict(L=Lr, pos=tree_lib.positions(tree, Lr), write_idx=meta.write_idx, kv_len=meta.kv_len,
                q_start=meta.q_start, mask=tree.mask.astype(jnp.int32), pt=meta.page_table[:, :4])


def show(tag, d):
    log(tag, {k: np.asarray(v).reshape(-1)[:80].tolist() for k, v in d.items()})


show("pieces jit 1 slot", jax.jit(pieces)(jax.device_put(st1)))
show("pieces jit padded", jax.jit(pieces)(jax.device_put(st2)))


def ver_fn(state):
    v = step_lib.verify_forward(info, spec, target, state, slots, active)
    return jnp.argmax(v.logits, -1)


log("verify_forward jit (own program), 1 slot", np.asarray(jax.jit(ver_fn)(jax.device_put(st1)))[0].tolist())
with jax.disable_jit():
    try:
        log("verify_forward eager, 1 slot", np.asarray(ver_fn(jax.device_put(st1)))[0].tolist())
    except Exception as e:  # noqa: BLE001
        log("eager FAILED", type(e).__name__, str(e)[:300])
log("DIAG DONE")
