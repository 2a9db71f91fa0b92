"""EAGLE-3 training (specjax.train) on a tiny random target with a word-level tokenizer:
the training forward equals the inference head over the paged cache (steps 0..2 of a chain),
data generation writes shards, training lowers the loss, checkpoint/resume continues the same run,
and the exported head loads and decodes losslessly in LLM (greedy output == plain output)."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_config
from tiny_dir import make_tiny_model_dir, tiny_hf_config, word_prompts

from specjax.checkpoint import CheckpointError, load_draft, read_meta
from specjax.kv_cache import meta_at
from specjax.models import eagle
from specjax.train import data as data_lib
from specjax.train import dataset, forward
from specjax.train.loss import LossConfig, ttt_loss
from specjax.train.trainer import TrainConfig, train

AUX = (1, 2, 3)
VD = 60


def _head(seed=0):
    """A random EAGLE-3 head with the tiny target's dimensions: (target cfg, head cfg, flat params
    (no d2t), EagleHead with the same state). Built from numpy (no eager random init: fast on CPU)."""
    cfg = tiny_config(num_hidden_layers=4)
    ecfg = forward.head_config(forward.head_hf_config(tiny_hf_config(4), VD, AUX), cfg)
    rng = np.random.default_rng(seed)
    flat = {k: (rng.normal(size=shape) * 0.2 if len(shape) > 1 else 1.0 + 0.1 * rng.normal(size=shape))
            .astype(np.float32) for k, (shape, _) in eagle.param_specs(ecfg).items() if k != "d2t"}
    d2t = np.sort(rng.choice(cfg.vocab_size, VD, replace=False)).astype(np.int32) - np.arange(VD, dtype=np.int32)
    abstract = nnx.eval_shape(lambda: eagle.EagleHead(ecfg, jnp.float32, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    full = {**flat, "d2t": d2t}

    def fill(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict):
                fill(value, f"{prefix}{key}.")
            else:
                node[key] = jnp.asarray(full[f"{prefix}{key}"])
    fill(pure, "")
    nnx.replace_by_pure_dict(state, pure)
    return cfg, ecfg, {k: jnp.asarray(v) for k, v in flat.items()}, nnx.merge(graphdef, state)


def test_training_forward_equals_paged_head():
    """Steps 0..2 of the unrolled forward over a packed row (two sequences + padding) equal the
    inference head: step 0 as a prefill over the paged cache, steps 1, 2 as chain nodes drafted
    from a root at index t (scratch entries with the engine's block mask)."""
    cfg, ecfg, flat, head = _head()
    E, T, K = cfg.hidden_size, 40, 3
    rng = np.random.default_rng(0)
    embed = jnp.asarray(rng.normal(size=(cfg.vocab_size, E)).astype(np.float32))
    na, nb = 13, 19
    ids = rng.integers(0, cfg.vocab_size, size=T).astype(np.int32)
    seg = np.array([1] * na + [2] * nb + [0] * (T - na - nb), np.int32)
    pos = np.concatenate([np.arange(na), np.arange(nb), np.zeros(T - na - nb, int)]).astype(np.int32)
    aux = rng.normal(size=(T, 3 * E)).astype(np.float32) * 2.0
    dims = forward.HeadDims.of(ecfg)
    unrolled = jax.jit(lambda *a: [(h, v) for _, h, v in forward.unrolled(flat, dims, embed, *a, K)])
    outs = {j: (np.asarray(h[0]), np.asarray(v[0])) for j, (h, v) in enumerate(unrolled(
        jnp.asarray(ids)[None], jnp.asarray(seg)[None], jnp.asarray(pos)[None], jnp.asarray(aux)[None]))}
    graphdef, state = nnx.split(head)
    head_call = jax.jit(lambda st, *a: nnx.merge(graphdef, st)(*a, embed))
    # validity: x_{t+1+j} in the same sequence
    assert outs[0][1][: na - 1].all() and not outs[0][1][na - 1] and not outs[0][1][na + nb - 1:].any()
    assert outs[2][1][na: na + nb - 3].all() and not outs[2][1][na + nb - 3]

    ps, W = 4, K - 1
    for a, n in ((0, na), (na, nb)):  # each sequence alone through the paged head
        sids, saux = ids[a: a + n], aux[a: a + n]
        cache = eagle.init_head_cache(ecfg, num_pages=16, page_size=ps, max_slots=1, max_seq_len=64,
                                      dtype=jnp.float32)
        pt = jnp.arange(1, 17, dtype=jnp.int32)[None]
        P = 24  # one padded prefill shape for both sequences (one compile)
        feats = head.features(tuple(jnp.split(jnp.asarray(np.pad(saux[: n - 1], ((0, P - n + 1), (0, 0))))[None],
                                              3, axis=-1)))
        h0, cache0 = head_call(state, jnp.asarray(np.pad(sids[1:], (0, P - n + 1)))[None],
                               jnp.arange(P, dtype=jnp.int32)[None], feats, cache,
                               meta_at(pt, jnp.zeros(1, jnp.int32), jnp.array([n - 1]), P, ps))
        np.testing.assert_allclose(outs[0][0][a: a + n - 1], np.asarray(h0[0, : n - 1]), rtol=2e-5, atol=2e-5)
        for t in (0, 3, n - 4):  # roots x_{t+1}: draft chain x_{t+2}, x_{t+3}
            Ld = t + 1
            c, feat = cache0, h0[:, t: t + 1]
            for j in range(1, K):
                bm = jnp.asarray(np.arange(W) < j)[None, None]  # ancestors' scratch entries + itself
                meta = meta_at(pt, jnp.array([Ld + j - 1]), jnp.array([1]), 1, ps, block_mask=bm,
                               mask_start=jnp.array([Ld]))
                feat, c = head_call(state, jnp.asarray(sids[t + 1 + j: t + 2 + j])[None],
                                    jnp.array([[t + j]], jnp.int32), feat, c, meta)
                np.testing.assert_allclose(outs[j][0][a + t], np.asarray(feat[0, 0]), rtol=2e-5, atol=2e-5,
                                           err_msg=f"step {j}, root index {t}")
    # logits too
    np.testing.assert_allclose(np.asarray(forward.draft_logits(flat, dims, jnp.asarray(outs[1][0])[None]))[0],
                               np.asarray(head.logits(jnp.asarray(outs[1][0])[None], None))[0], rtol=1e-5,
                               atol=1e-4)


def test_loss_masks_and_vocab():
    counts = np.array([5, 0, 9, 9, 1, 7])
    d2t, t2d, cov = dataset.draft_vocab(counts, 3)
    assert list(d2t + np.arange(3)) == [2, 3, 5] and list(t2d) == [-1, -1, 0, 1, -1, 2]
    assert cov == pytest.approx(25 / 31)
    w = np.arange(12, dtype=np.float32).reshape(2, 6)  # [E, V]
    init = forward.target_init({"lm_head": w, "norm.scale": np.full(2, 3.0)}, d2t)
    assert init["lm_head"].tolist() == w[:, [2, 3, 5]].tolist() and init["norm.scale"].tolist() == [3.0, 3.0]
    tied = forward.target_init({"embed": w.T, "norm.scale": np.ones(2)}, d2t)  # tied: embed [V, E]
    assert tied["lm_head"].tolist() == w[:, [2, 3, 5]].tolist()
    cfg, ecfg, flat, _ = _head()
    dims = forward.HeadDims.of(ecfg)
    B, T, E = 2, 16, cfg.hidden_size
    batch = {"ids": jnp.ones((B, T), jnp.int32), "seg": jnp.ones((B, T), jnp.int32),
             "pos": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
             "aux": jnp.zeros((B, T, 3 * E), jnp.uint16), "label": jnp.full((B, T), -1, jnp.int32)}
    embed = jnp.zeros((cfg.vocab_size, E))
    loss_fn = jax.jit(lambda b: ttt_loss(flat, embed, b, dims, LossConfig(3)))
    loss, m = loss_fn(batch)
    assert float(loss) == 0.0 and list(np.asarray(m["count"])) == [0, 0, 0]
    batch["label"] = batch["label"].at[:, 5].set(7)
    _, m = loss_fn(batch)
    assert list(np.asarray(m["count"])) == [2, 2, 2]  # label at 5 is seen by steps 0, 1, 2 at t = 4, 3, 2


def test_refuses_eval_sets(tmp_path):
    for name in ("gsm8k_test.jsonl", "mt_bench.jsonl", "humaneval.jsonl", "sum.jsonl"):
        with pytest.raises(data_lib.DataError, match="evaluation set"):
            data_lib.check_not_eval(tmp_path / name)
    with pytest.raises(data_lib.DataError, match="evaluation set"):
        data_lib.check_not_eval(tmp_path / "prompts" / "anything.jsonl")
    data_lib.check_not_eval(tmp_path / "train" / "gsm8k_train.jsonl")
    rows = tmp_path / "train.jsonl"
    mt = data_lib.read_prompts(data_lib.EVAL_PROMPTS_DIR / "mt_bench.jsonl", allow_eval=True)[0]
    rows.write_text("\n".join(json.dumps(r) for r in [{"question": "q1"}, {"turns": ["q2", "x"]},
                                                      {"prompt": mt}, {"other": 1}]) + "\n")
    cfg = data_lib.DataConfig([str(rows)], str(tmp_path / "out"))
    assert sorted(data_lib.select_prompts(cfg)) == [("q1", None), ("q2", None)]  # the eval prompt is dropped


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """Tiny target dir -> data (8 prompts, 2 temperatures) -> 30 training steps -> export."""
    root = tmp_path_factory.mktemp("train")
    model = make_tiny_model_dir(root / "model")
    prompts = root / "prompts_train.jsonl"
    prompts.write_text("".join(json.dumps({"question": p}) + "\n" for p in word_prompts(8)))
    dcfg = data_lib.DataConfig([str(prompts)], str(root / "data"), model_dir=str(model), dtype="float32",
                               temperatures=(0.0, 1.0), max_tokens=24, max_seq_len=64, max_batch=4,
                               chunk_prompts=4, tokens_per_batch=256, aux_layers=AUX, progress=False)
    man = data_lib.build_data(dcfg)
    tcfg = TrainConfig(data_dir=str(root / "data"), work_dir=str(root / "work"), export_dir=str(root / "head"),
                       steps=30, batch_size=2, seq_len=64, lr=3e-2, warmup=3, ttt_steps=3, draft_vocab_size=VD,
                       ckpt_every=20, log_every=5, progress=False, export_dtype="float32", devices=1)
    summary = train(tcfg)
    return root, model, man, tcfg, summary, dcfg


def test_data_shards(pipeline):
    root, model, man, _, _, dcfg = pipeline
    assert man["complete"] and len(man["shards"]) == 2 and man["num_seqs"] == 8
    assert man["aux_layers"] == list(AUX)
    stamp = [(root / "data" / s["file"]).stat().st_mtime_ns for s in man["shards"]]
    again = data_lib.build_data(dcfg)  # every chunk is done: nothing is regenerated
    assert again["shards"] == man["shards"] and again["complete"]
    assert [(root / "data" / s["file"]).stat().st_mtime_ns for s in man["shards"]] == stamp
    with pytest.raises(data_lib.DataError, match="other settings"):
        data_lib.build_data(dataclasses.replace(dcfg, temperatures=(0.5,)))
    with pytest.raises(data_lib.DataError, match="other settings"):  # made without: not resumed with a share
        data_lib.build_data(dataclasses.replace(dcfg, ignore_eos_share=0.3))
    _, shards = data_lib.load_shards(root / "data")
    sh = shards[0]
    assert sh.aux.dtype == np.uint16 and sh.aux.shape == (sh.ids.shape[0], 3 * 32)
    # the stored features are the target's aux hidden states; next_ids its greedy predictions
    from specjax.checkpoint import load_model
    from specjax.kv_cache import init_cache
    cfg, target = load_model(model, "float32")
    n = int(sh.offsets[1])
    cache = init_cache(cfg, num_pages=8, page_size=16, max_slots=1, max_seq_len=64, dtype=jnp.float32)
    pt = jnp.arange(1, 5, dtype=jnp.int32)[None]
    cache = type(cache)(kv=cache.kv, page_table=pt, seq_lens=cache.seq_lens)
    graphdef, state = nnx.split(target)

    @jax.jit
    def run(state, tokens, cache):
        m = nnx.merge(graphdef, state)
        h, _, aux = m(tokens, jnp.arange(n, dtype=jnp.int32)[None], cache,
                      meta_at(pt, jnp.zeros(1, jnp.int32), jnp.array([n]), n, 16), AUX)
        return jnp.concatenate(aux, -1)[0].astype(jnp.bfloat16), jnp.argmax(m.logits(h), -1)[0]
    ref, nxt = run(state, jnp.asarray(sh.ids[:n])[None], cache)
    got = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(sh.aux[:n]), jnp.bfloat16))
    np.testing.assert_allclose(got.astype(np.float32), np.asarray(ref).astype(np.float32), rtol=1e-2, atol=1e-2)
    assert (np.asarray(nxt) == sh.next_ids[:n]).all()
    # greedy rows (temperature 0, even prompt indices): the response is the target's argmax chain
    p = int(sh.prompt_lens[0])
    assert (sh.ids[p:n] == sh.next_ids[p - 1: n - 1]).all()


def test_data_workers_share_one_directory(pipeline, tmp_path):
    """Two workers (chunks k % 2) write into one directory, each its own manifest; the join is one
    manifest.json (partial when a worker stopped on its time budget); a rerun with one worker makes
    only the missing chunk. The shards equal those of one process."""
    root, _, man, _, _, dcfg = pipeline
    d = tmp_path / "d"
    part = dataclasses.replace(dcfg, out_dir=str(d), workers=2)
    w0 = data_lib.build_data(dataclasses.replace(part, worker=0))
    w1 = data_lib.build_data(dataclasses.replace(part, worker=1, time_budget=0.0))
    assert [s["chunk"] for s in w0["shards"]] == [0] and w0["complete"]
    assert w1["shards"] == [] and not w1["complete"]
    assert sorted(p.name for p in d.glob("manifest*")) == ["manifest.0-of-2.json", "manifest.1-of-2.json"]
    joined = data_lib.merge_manifests(d, "joined")
    assert [s["chunk"] for s in joined["shards"]] == [0] and not joined["complete"]
    assert joined["workers"] == 2 and joined["command"] == "joined"
    assert sorted(p.name for p in d.glob("manifest*")) == ["manifest.json"]
    stamp = (d / "shard-00000.npz").stat().st_mtime_ns
    again = data_lib.build_data(dataclasses.replace(dcfg, out_dir=str(d)))
    assert again["complete"] and [s["chunk"] for s in again["shards"]] == [0, 1]
    assert (d / "shard-00000.npz").stat().st_mtime_ns == stamp
    _, ref = data_lib.load_shards(root / "data")
    _, got = data_lib.load_shards(d)
    for a, b in zip(ref, got):
        assert (a.ids == b.ids).all() and (a.offsets == b.offsets).all() and (a.prompt_lens == b.prompt_lens).all()
    with pytest.raises(data_lib.DataError, match="other settings"):
        data_lib.build_data(dataclasses.replace(part, worker=1, temperatures=(0.5,)))


def test_prompt_workers_cli(tmp_path):
    """`train_eagle.py prompts --workers 2`: two processes over disjoint files, joined into one file
    (their parts removed)."""
    import subprocess
    import sys
    out = tmp_path / "p.jsonl"
    script = Path(__file__).resolve().parent.parent / "scripts" / "train_eagle.py"
    r = subprocess.run([sys.executable, str(script), "prompts", "--out", str(out), "--self-instruct", "0",
                        "--passages", "7", "--schemas", "3", "--workers", "2"], capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 10 and len({r["prompt"] for r in rows}) == 10
    assert sum(r["source"] == "schema" for r in rows) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]
    assert r.stderr.count("[prompts] 3 passage prompts") + r.stderr.count("[prompts] 4 passage prompts") == 2


def test_training_lowers_loss_and_exports(pipeline):
    root, model, _, _, summary, _ = pipeline
    log = [json.loads(x) for x in (root / "work" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [5, 10, 15, 20, 25, 30]
    assert log[-1]["total"] < 0.75 * log[0]["total"], (log[0]["total"], log[-1]["total"])
    assert summary["step"] == 30 and (root / "work" / "curves.png").stat().st_size > 1000
    assert read_meta(root / "head")["kind"] == "eagle3"
    assert "training-time test" in (root / "head" / "TRAINING.md").read_text()
    from specjax.checkpoint import load_config
    _, ecfg = load_draft(root / "head", load_config(model), "float32")
    assert ecfg.aux_layers == AUX and ecfg.draft_vocab_size == VD


def test_resume_continues_same_run(pipeline, tmp_path):
    """Stop at step 20, then resume to 30: the same log as the uninterrupted run."""
    root, _, _, tcfg, _, _ = pipeline
    part = dataclasses.replace(tcfg, work_dir=str(tmp_path / "w"), export_dir=None, stop_at=20)
    s1 = train(part)
    assert s1["step"] == 20 and s1["stopped_early"]
    with pytest.raises(ValueError, match="already holds checkpoints"):
        train(dataclasses.replace(part, stop_at=None))
    s2 = train(dataclasses.replace(part, stop_at=None, resume=True))
    assert s2["resumed_from"] == 20 and s2["step"] == 30
    full = [json.loads(x) for x in (root / "work" / "train_log.jsonl").read_text().splitlines()]
    got = [json.loads(x) for x in (tmp_path / "w" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [r["step"] for r in full]
    for a, b in zip(full, got):
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-4, err_msg=f"step {a['step']}")


def test_exported_head_in_specjax_eval(pipeline, capsys):
    """`specjax eval` with the exported head: speculative greedy output == plain output, a real
    acceptance (the head has learnt its training prompts), the table, JSON and PNG written."""
    from specjax import cli
    root, model, _, _, _, _ = pipeline
    texts = [json.loads(x)["question"] for x in (root / "prompts_train.jsonl").read_text().splitlines()]
    pf = root / "evalset.jsonl"
    pf.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in texts[0:4:2]))  # greedy-trained ones
    out = root / "eval"
    rc = cli.main(["eval", "--model", str(model), "--draft", str(root / "head"), "--prompts", str(pf),
                   "--max-tokens", "16", "--dtype", "float32", "--max-seq-len", "128", "--num-steps", "3",
                   "--json", f"{out}.json", "--markdown", f"{out}.md", "--png", f"{out}.png"])
    assert rc == 0, capsys.readouterr().err
    s = json.loads(Path(f"{out}.json").read_text())
    c = s["categories"]["evalset"]
    assert c["prompts"] == 2 and c["identical"] == 2 and c["tokens_plain"] == c["tokens_spec"] > 0
    assert c["tau"] > 1.0 and s["overall"]["tau"] == pytest.approx(c["tau"])
    assert "| evalset | 2 |" in Path(f"{out}.md").read_text() and "| evalset | 2 |" in capsys.readouterr().out
    # the share of the plain output the head's own vocabulary (VD of 97 ids) could have proposed
    from specjax import LLM, SamplingParams
    from specjax import eval as spec_eval
    from specjax.checkpoint import load_draft_flat
    llm = LLM(str(model), dtype="float32", max_seq_len=128)
    flat, _, _ = load_draft_flat(root / "head", llm.cfg, "float32")
    ids = set((np.asarray(flat["d2t"]) + np.arange(VD)).tolist())
    prompts = spec_eval._ids(llm, texts[0:4:2], bool(llm.tokenizer.chat_template))
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    want = sum(t in ids for o in outs for t in o.token_ids)
    assert 0 < want, "the check needs outputs inside the head vocabulary"
    assert s["settings"]["draft_vocab_size"] == VD and c["in_draft_vocab"] == want == s["overall"]["in_draft_vocab"]
    assert f"in draft vocab ({VD})" in Path(f"{out}.md").read_text()
    assert Path(f"{out}.png").stat().st_size > 1000


def test_target_features_on_packed_rows_equal_stored(pipeline):
    """specjax.train.target over a packed row holding two sequences (+ padding) gives the features
    and greedy predictions the paged prefill stored for each sequence alone."""
    from specjax.checkpoint import load_flat
    from specjax.train.target import TargetDims, target_features
    root, model, _, _, _, _ = pipeline
    _, shards = data_lib.load_shards(root / "data")
    sh = shards[0]
    a0, a1, a2 = (int(x) for x in sh.offsets[:3])
    T = a2 + 5
    ids = np.zeros((1, T), np.int32)
    seg = np.zeros((1, T), np.int32)
    pos = np.zeros((1, T), np.int32)
    ids[0, :a2] = sh.ids[:a2]
    seg[0, :a1], seg[0, a1:a2] = 1, 2
    pos[0, :a1], pos[0, a1:a2] = np.arange(a1), np.arange(a2 - a1)
    cfg, flat = load_flat(model, "float32")
    tp = {k: jnp.asarray(v) for k, v in flat.items()}
    aux, nxt = jax.jit(target_features, static_argnums=(1, 5))(tp, TargetDims.of(cfg), jnp.asarray(ids),
                                                               jnp.asarray(seg), jnp.asarray(pos), AUX)
    stored = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(sh.aux[:a2]), jnp.bfloat16)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(aux[0, :a2]), stored, rtol=1e-2, atol=1e-2)
    assert (np.asarray(nxt[0, :a2]) == sh.next_ids[:a2]).all()


def test_token_only_data_trains_with_heldout(pipeline, tmp_path):
    """Shards of token ids only (features=False): the step computes the target's features; the
    loss falls and the held-out split reports acc@1..K in the log and TRAINING.md."""
    root, model, _, tcfg, _, dcfg = pipeline
    man = data_lib.build_data(dataclasses.replace(dcfg, out_dir=str(tmp_path / "d"), features=False))
    _, shards = data_lib.load_shards(tmp_path / "d")
    assert man["features"] is False and shards[0].aux.shape[0] == 0 and shards[0].ids.shape[0] > 0
    s = train(dataclasses.replace(tcfg, data_dir=str(tmp_path / "d"), work_dir=str(tmp_path / "w"),
                                  export_dir=str(tmp_path / "head"), heldout=0.25, eval_every=10))
    log = [json.loads(x) for x in (tmp_path / "w" / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["total"] < 0.75 * log[0]["total"], (log[0]["total"], log[-1]["total"])
    held = [r["heldout"] for r in log if "heldout" in r]
    assert [r["step"] for r in log if "heldout" in r] == [10, 20, 30]
    assert len(held[-1]["acc"]) == tcfg.ttt_steps and held[-1]["tokens"] > 0
    assert all(0.0 <= a <= 1.0 for a in held[-1]["acc"])
    assert s["final"]["heldout"] == held[-1]
    assert "acc@k held-out" in (tmp_path / "head" / "TRAINING.md").read_text()


def test_two_devices_train_as_one(pipeline, tmp_path):
    """Data parallel over 2 devices (2 rows each) is the 1-device run on the same global batch of 4
    rows: the same losses, held-out metrics and weights (float32 tolerance), also across a
    checkpoint and resume. Token ids only: the target's features are computed on the split batch."""
    from specjax.checkpoint import load_config, load_draft_flat
    if len(jax.local_devices()) < 2:
        pytest.skip("needs 2 devices (tests/conftest.py asks for 8 CPU devices)")
    root, model, _, tcfg, _, dcfg = pipeline
    data_lib.build_data(dataclasses.replace(dcfg, out_dir=str(tmp_path / "d"), features=False))
    base = dataclasses.replace(tcfg, data_dir=str(tmp_path / "d"), steps=6, log_every=1, eval_every=3,
                               heldout=0.25, ckpt_every=100)
    one = train(dataclasses.replace(base, work_dir=str(tmp_path / "w1"), export_dir=str(tmp_path / "h1"),
                                    devices=1, batch_size=4))
    two = dataclasses.replace(base, work_dir=str(tmp_path / "w2"), export_dir=str(tmp_path / "h2"),
                              devices=2, batch_size=2)
    assert train(dataclasses.replace(two, stop_at=3))["step"] == 3
    s2 = train(dataclasses.replace(two, resume=True))
    assert s2["resumed_from"] == 3 and s2["tokens_per_step"] == one["tokens_per_step"] == 4 * tcfg.seq_len
    assert s2["config"]["devices"] == 2 and "batch 4 (2 devices x 2)" in (tmp_path / "h2" / "TRAINING.md").read_text()
    logs = [[json.loads(x) for x in (tmp_path / w / "train_log.jsonl").read_text().splitlines()] for w in ("w1", "w2")]
    assert [r["step"] for r in logs[1]] == [r["step"] for r in logs[0]] == list(range(1, 7))
    for a, b in zip(*logs):
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5, err_msg=f"step {a['step']}")
        np.testing.assert_allclose(b["gnorm"], a["gnorm"], rtol=1e-4, err_msg=f"step {a['step']}")
        assert b["count"] == a["count"]
        if "heldout" in a:
            assert b["heldout"]["acc"] == a["heldout"]["acc"]
            np.testing.assert_allclose(b["heldout"]["loss"], a["heldout"]["loss"], rtol=1e-4, atol=1e-4)
    cfg = load_config(model)
    w1, _, _ = load_draft_flat(tmp_path / "h1", cfg, "float32")
    w2, _, _ = load_draft_flat(tmp_path / "h2", cfg, "float32")
    for k in w1:
        np.testing.assert_allclose(np.asarray(w2[k]), np.asarray(w1[k]), rtol=1e-4, atol=1e-5, err_msg=k)


def test_init_head_continues_from_exported_weights(pipeline, tmp_path):
    """--init-head: training starts from an exported head's weights and draft vocabulary (with a zero
    learning rate the export equals the head it started from; its first loss is the trained one) and
    keeps that head's tuned tree settings (spec_defaults), marked as carried over."""
    import shutil
    from specjax.checkpoint import head_spec_defaults, load_config, load_draft_flat, read_meta
    root, model, _, tcfg, _, _ = pipeline
    init = tmp_path / "init"
    shutil.copytree(root / "head", init)
    meta = read_meta(init)
    assert "spec_defaults" not in meta  # a fresh export carries none
    tuned = {"1": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}, "8": "plain"}
    (init / "specjax.json").write_text(json.dumps(dict(meta, spec_defaults=tuned,
                                                      spec_defaults_measured={"device": "some GPU"})))
    cont = dataclasses.replace(tcfg, work_dir=str(tmp_path / "w"), export_dir=str(tmp_path / "head"), steps=5,
                               lr=0.0, init_head=str(init))
    train(cont)
    out = read_meta(tmp_path / "head")
    assert out["spec_defaults"] == tuned and out["spec_defaults_measured"]["device"] == "some GPU"
    assert str(init) in out["spec_defaults_measured"]["carried_over_from"]
    assert head_spec_defaults(tmp_path / "head", 1)[0] == tuned["1"]
    cfg = load_config(model)
    before, _, _ = load_draft_flat(init, cfg, "float32")
    after, _, _ = load_draft_flat(tmp_path / "head", cfg, "float32")
    assert sorted(before) == sorted(after)
    for k in before:
        np.testing.assert_array_equal(np.asarray(after[k]), np.asarray(before[k]), err_msg=k)
    fresh = [json.loads(x) for x in (root / "work" / "train_log.jsonl").read_text().splitlines()]
    got = [json.loads(x) for x in (tmp_path / "w" / "train_log.jsonl").read_text().splitlines()]
    assert got[0]["total"] < 0.75 * fresh[0]["total"], (got[0]["total"], fresh[0]["total"])
    with pytest.raises(CheckpointError, match="does not exist"):
        train(dataclasses.replace(cont, work_dir=str(tmp_path / "w2"), init_head=str(tmp_path / "nohead")))


def test_init_head_grows_its_draft_vocabulary(pipeline, tmp_path):
    """--init-head with a larger --draft-vocab: the head's ids stay, the most frequent other labels join;
    with a zero learning rate the export keeps the head's lm_head columns at its ids and the target's
    output columns at the new ones; a smaller size is refused."""
    from specjax.checkpoint import load_config, load_draft_flat, load_flat
    root, model, _, tcfg, _, _ = pipeline
    grow = dataclasses.replace(tcfg, work_dir=str(tmp_path / "w"), export_dir=str(tmp_path / "head"), steps=2,
                               lr=0.0, init_head=str(root / "head"), draft_vocab_size=VD + 20)
    summary = train(grow)
    assert summary["draft_vocab_size"] == VD + 20 and summary["draft_vocab_from_head"] == VD
    assert f"{VD + 20} ids: the initial head's {VD} and the 20 most frequent" in \
        (tmp_path / "head" / "TRAINING.md").read_text()
    cfg = load_config(model)
    before, _, _ = load_draft_flat(root / "head", cfg, "float32")
    after, ecfg, _ = load_draft_flat(tmp_path / "head", cfg, "float32")
    assert ecfg.draft_vocab_size == VD + 20
    old = np.asarray(before["d2t"]) + np.arange(VD)
    new = np.asarray(after["d2t"]) + np.arange(VD + 20)
    assert np.all(np.diff(new) > 0) and set(old) < set(new)
    at = np.searchsorted(new, old)
    np.testing.assert_array_equal(np.asarray(after["lm_head"])[:, at], np.asarray(before["lm_head"]))
    added = np.setdiff1d(np.arange(VD + 20), at)
    _, tflat = load_flat(model, "float32")
    w = tflat["lm_head"] if "lm_head" in tflat else np.asarray(tflat["embed"]).T
    np.testing.assert_allclose(np.asarray(after["lm_head"])[:, added], np.asarray(w)[:, new[added]], rtol=1e-6)
    for k in before:
        if k not in ("lm_head", "d2t"):
            np.testing.assert_array_equal(np.asarray(after[k]), np.asarray(before[k]), err_msg=k)
    # the added ids are the most frequent labels outside the head's vocabulary
    _, shards = data_lib.load_shards(root / "data")
    counts = dataset.label_counts(shards, cfg.vocab_size)
    others = np.setdiff1d(np.arange(cfg.vocab_size), old)
    assert counts[new[added]].min() >= np.sort(counts[np.setdiff1d(others, new[added])])[-1]
    with pytest.raises(ValueError, match="can grow, not shrink"):
        train(dataclasses.replace(grow, work_dir=str(tmp_path / "w3"), draft_vocab_size=VD - 1))


def test_init_head_widens_its_mlp(pipeline, tmp_path):
    """--head-intermediate above the initial head's MLP width: its units keep their weights, the new
    ones start with zero down-projection rows, so with a zero learning rate the widened head's losses
    equal the unwidened continuation's step for step; the export loads at the new width; narrowing
    is refused."""
    from specjax.checkpoint import load_config, load_draft_flat
    root, model, _, tcfg, _, _ = pipeline
    cfg = load_config(model)
    before, hcfg, _ = load_draft_flat(root / "head", cfg, "float32")
    F0 = hcfg.layer.intermediate_size
    same = dataclasses.replace(tcfg, work_dir=str(tmp_path / "w0"), export_dir=str(tmp_path / "h0"), steps=3,
                               lr=0.0, init_head=str(root / "head"))
    wide = dataclasses.replace(same, work_dir=str(tmp_path / "w1"), export_dir=str(tmp_path / "h1"),
                               head_intermediate=F0 + 24)
    assert train(same)["mlp_widened_by"] == 0
    summary = train(wide)
    assert summary["mlp_width"] == F0 + 24 and summary["mlp_widened_by"] == 24
    assert f"MLP width {F0 + 24}: the initial head's grown by 24 units" in (tmp_path / "h1" / "TRAINING.md").read_text()
    after, ecfg, _ = load_draft_flat(tmp_path / "h1", cfg, "float32")
    assert ecfg.layer.intermediate_size == F0 + 24
    for k in ("mlp.w_gate", "mlp.w_up"):
        np.testing.assert_array_equal(np.asarray(after[k])[:, :F0], np.asarray(before[k]), err_msg=k)
        assert np.abs(np.asarray(after[k])[:, F0:]).min(axis=0).max() > 0, k  # fresh columns, not zeros
    np.testing.assert_array_equal(np.asarray(after["mlp.w_down"])[:F0], np.asarray(before["mlp.w_down"]))
    assert not np.asarray(after["mlp.w_down"])[F0:].any()
    for k in before:
        if not k.startswith("mlp.w_"):
            np.testing.assert_array_equal(np.asarray(after[k]), np.asarray(before[k]), err_msg=k)
    logs = [[json.loads(x) for x in (tmp_path / w / "train_log.jsonl").read_text().splitlines()] for w in ("w0", "w1")]
    assert logs[0] and [r["step"] for r in logs[0]] == [r["step"] for r in logs[1]]
    for r0, r1 in zip(*logs):
        np.testing.assert_allclose(r1["total"], r0["total"], rtol=1e-5)
    # the engine drafts with it: the same accepted lengths as the unwidened head, plain's greedy output
    from specjax import LLM, SamplingParams
    from specjax.tree import SpecConfig
    from specjax import eval as spec_eval
    texts = [json.loads(x)["question"] for x in (root / "prompts_train.jsonl").read_text().splitlines()][:2]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for name in ("h0", "h1", None):
        llm = LLM(str(model), dtype="float32", max_seq_len=128, max_batch=2,
                  draft=str(tmp_path / name) if name else None,
                  spec=SpecConfig(method="eagle3", num_steps=3, topk=2, num_draft_tokens=4) if name else None)
        runs[name] = spec_eval._run(llm, spec_eval._ids(llm, texts, bool(llm.tokenizer.chat_template)), params)
    assert [o.token_ids for o, _ in runs["h1"]] == [o.token_ids for o, _ in runs[None]]
    assert [a for _, a in runs["h1"]] == [a for _, a in runs["h0"]] and any(len(a) for _, a in runs["h1"])
    with pytest.raises(ValueError, match="can widen it, not narrow it"):
        train(dataclasses.replace(wide, work_dir=str(tmp_path / "w2"), head_intermediate=F0 - 8))


def test_schema_prompts_stay_on_the_device_dfa():
    """The random schemas of specjax.train.schemas: reproducible with a seed, varied, and each in
    the subset json_schema_regex puts on the device DFA (no request falls back to the host path)."""
    from specjax.json_schema_regex import schema_regex
    from specjax.train.schemas import schema_prompts
    rows = schema_prompts(300, seed=4)
    assert rows == schema_prompts(300, seed=4) and rows != schema_prompts(300, seed=5)
    assert len({json.dumps(r["json_schema"]) for r in rows}) > 250
    for r in rows:
        assert r["source"] == "schema" and json.dumps(r["json_schema"]) in r["prompt"]
        schema_regex(r["json_schema"])  # raises SchemaUnsupported otherwise


def test_schema_rows_are_generated_under_their_schema(tmp_path):
    """A prompt row with "json_schema" is answered under that schema: on the default model, every
    stored response token is one the schema's token DFA allows (a response cut by max_tokens is a
    prefix; one that ended validates as JSON), and the unconstrained row is not constrained."""
    from helpers import default_model_or_skip
    jsonschema = pytest.importorskip("jsonschema")
    xgrammar = pytest.importorskip("xgrammar")
    from specjax.checkpoint import load_tokenizer
    from specjax.json_schema_regex import schema_regex
    from specjax.regex_dfa import compile_regex
    from specjax.token_dfa import build_token_dfa, vocab_token_bytes
    from specjax.train.schemas import schema_prompts
    model = default_model_or_skip()
    rows = schema_prompts(2, seed=1) + [{"question": "Say hi."}]
    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = data_lib.DataConfig([str(f)], str(tmp_path / "out"), model_dir=str(model), dtype="float32",
                              temperatures=(0.0,), max_tokens=96, max_seq_len=512, max_batch=4, chunk_prompts=8,
                              features=False, progress=False)
    man = data_lib.build_data(cfg)
    assert man["shards"][0]["schema_seqs"] == 2 and man["shards"][0]["failed"] == 0
    _, shards = data_lib.load_shards(tmp_path / "out")
    tok = load_tokenizer(model)
    info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=49152)
    sh = shards[0]
    checked = 0
    for i in range(len(sh.prompt_lens)):
        start, end = sh.offsets[i] + sh.prompt_lens[i], sh.offsets[i + 1]
        prompt = tok.decode(sh.ids[sh.offsets[i]: start])
        row = next(r for r in rows if r.get("prompt", r.get("question")) in prompt)
        if "json_schema" not in row:
            continue
        td = build_token_dfa(compile_regex(schema_regex(row["json_schema"]), xgrammar=True),
                             vocab_token_bytes(info), info.stop_token_ids, 49152)
        state = 0
        for t in sh.ids[start:end].tolist():
            if t in info.stop_token_ids:
                assert td.accept[state]
                text = tok.decode(sh.ids[start:end], skip_special_tokens=True)
                jsonschema.validate(json.loads(text), row["json_schema"])
                break
            state = td.step(state, t)  # raises on a token the schema forbids
        checked += 1
    assert checked == 2


def test_ignore_eos_share_is_drawn_per_prompt(tmp_path):
    """DataConfig.ignore_eos_share: that share of the prompts (drawn per prompt index from the data
    seed: the same in a resumed or parallel run) is generated with EOS ignored, never a schema row;
    the shard info counts them; a share outside [0, 1] is refused."""
    import types

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [1 + len(text) % 7, 2, 3]

    class FakeLLM:
        tokenizer = Tok()

        def __init__(self):
            self.params = []

        def apply_chat_template(self, msgs):
            return msgs[0]["content"]

        def generate(self, ids, params):
            self.params += params
            return [types.SimpleNamespace(finish_reason="length", token_ids=[5, 6], error=None) for _ in ids]

    items = [(f"prompt {i}", None) for i in range(400)] + [("a schema row", {"type": "object"})]

    def flags(share, seed=3):
        cfg = data_lib.DataConfig(["unused"], str(tmp_path / "out"), max_tokens=2, max_seq_len=64,
                                  ignore_eos_share=share, seed=seed)
        llm = FakeLLM()
        _, info = data_lib._make_chunk(cfg, llm, None, items, first_index=100)
        got = [p.ignore_eos for p in llm.params]
        assert info["ignore_eos_seqs"] == sum(got) and not got[-1]  # the schema row keeps its EOS
        assert got[:-1] == [data_lib.ignores_eos(cfg, 100 + i) for i in range(400)]
        return got[:-1]

    quarter = flags(0.25)
    assert 0.18 < np.mean(quarter) < 0.32 and flags(0.25) == quarter  # drawn, and the same again
    assert flags(0.25, seed=4) != quarter
    assert not any(flags(0.0)) and all(flags(1.0))
    with pytest.raises(data_lib.DataError, match="ignore_eos_share must be in"):
        data_lib.build_data(data_lib.DataConfig(["unused"], str(tmp_path / "bad"), ignore_eos_share=1.5))
