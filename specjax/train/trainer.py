"""Train an EAGLE-3 head on data shards (specjax.train.data) and export it as a draft directory.

WORK_DIR holds: vocab.npz (d2t, t2d), ckpt/ (orbax: params + optimizer state, every ckpt_every
steps and at the end), train_log.jsonl (one line per log_every steps), curves.png, summary.json.
`resume=True` continues from the latest checkpoint (same data order: batches depend on the step
only); without it a work directory that already holds checkpoints is refused.
Data parallel over the first `devices` local devices (specjax.train.mesh): each step takes
devices x batch_size rows; params and optimizer state are replicated.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.train import dataset, forward
from specjax.train.data import load_shards
from specjax.train.loss import LossConfig, tau_estimate, ttt_loss
from specjax.train.mesh import DataParallel


DRAFT_VOCAB = 16384  # draft vocabulary of a head trained from scratch, unless told


@dataclasses.dataclass
class TrainConfig:
    data_dir: str
    work_dir: str
    export_dir: str | None = None
    model_dir: str | None = None  # None: the manifest's model
    steps: int = 1000
    batch_size: int = 8  # rows per device; a step takes devices x batch_size rows
    devices: int | None = None  # data parallel over the first N local devices (None: all)
    seq_len: int = 2048
    lr: float = 5e-4
    warmup: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    clip: float = 0.5
    ttt_steps: int = 6
    decay: float = 0.8
    draft_vocab_size: int | None = None  # None: DRAFT_VOCAB, or init_head's; larger than init_head's: grown
    init_from_target: bool = True  # lm_head / final norm start as the target's (draft-vocab columns)
    init_head: str | None = None  # continue from an exported head (its weights and draft vocabulary)
    head_intermediate: int | None = None  # MLP width (None: init_head's, else the target's); wider than init_head's: grown
    ckpt_every: int = 200
    log_every: int = 10
    heldout: float = 0.01  # share of packed rows held out for acc@k (0: none)
    eval_every: int = 200  # steps between held-out evaluations (and at the end)
    seed: int = 0
    compute_dtype: str = "auto"  # auto: bfloat16 on GPU, float32 elsewhere
    param_dtype: str = "float32"  # master weights (and Adam moments)
    export_dtype: str = "bfloat16"
    time_budget: float | None = None  # seconds of training; then checkpoint + export
    stop_at: int | None = None  # stop (checkpoint, export) after this step; resume later
    resume: bool = False
    progress: bool = True
    command: str = ""


@dataclasses.dataclass(frozen=True)
class OptConfig:
    lr: float
    warmup: int
    steps: int
    min_lr_ratio: float
    weight_decay: float
    clip: float

    def schedule(self):
        import optax
        warm = max(1, min(self.warmup, self.steps - 1))
        return optax.warmup_cosine_decay_schedule(0.0, self.lr, warm, max(self.steps, warm + 1),
                                                  self.lr * self.min_lr_ratio)

    def optimizer(self):
        import optax
        return optax.chain(optax.clip_by_global_norm(self.clip),
                           optax.adamw(self.schedule(), b1=0.9, b2=0.95, weight_decay=self.weight_decay))


def with_features(batch, target, t2d, tdims, aux_layers: tuple[int, ...], dtype):
    """A batch of token ids only gets the target's features and labels (label 0 marks the loss
    span): computed here, no gradient flows into the target. Stored-feature batches pass as is."""
    if "aux" in batch:
        return batch
    from specjax.train.target import target_features
    tp = {k: v.astype(dtype) for k, v in target.items()}
    aux, nxt = jax.lax.stop_gradient(
        target_features(tp, tdims, batch["ids"], batch["seg"], batch["pos"], aux_layers))
    return {**batch, "aux": aux, "label": jnp.where(batch["label"] >= 0, t2d[nxt], -1)}


@functools.lru_cache(maxsize=8)
def train_step_fn(dims: forward.HeadDims, lcfg: LossConfig, ocfg: OptConfig, tdims=None, aux_layers=(),
                  out_sharding=None):
    """Jitted (params, opt_state, embed, target, t2d, batch) -> (params, opt_state, metrics);
    cached per config so that repeated runs in one process reuse the compiled program. `target`
    (flat target params) and t2d are used only by batches without stored features. out_sharding:
    where the outputs live (DataParallel.replicated), the batch may be split over devices."""
    import optax
    opt = ocfg.optimizer()

    def step(params, opt_state, embed, target, t2d, batch):
        batch = with_features(batch, target, t2d, tdims, aux_layers, jnp.dtype(lcfg.compute_dtype))
        (loss, m), grads = jax.value_and_grad(ttt_loss, has_aux=True)(params, embed, batch, dims, lcfg)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {**m, "total": loss, "gnorm": optax.tree.norm(grads)}
    return jax.jit(step, donate_argnums=(0, 1), out_shardings=out_sharding)


@functools.lru_cache(maxsize=8)
def eval_step_fn(dims: forward.HeadDims, lcfg: LossConfig, tdims=None, aux_layers=()):
    """Jitted (params, embed, target, t2d, batch) -> metrics of the held-out batch (no update)."""
    def step(params, embed, target, t2d, batch):
        batch = with_features(batch, target, t2d, tdims, aux_layers, jnp.dtype(lcfg.compute_dtype))
        loss, m = ttt_loss(params, embed, batch, dims, lcfg)
        return {**m, "total": loss}
    return jax.jit(step)


def _log(msg: str) -> None:
    print(f"[train] {msg}", file=sys.stderr, flush=True)


def _compute_dtype(name: str) -> str:
    if name == "auto":
        return "bfloat16" if jax.default_backend() == "gpu" else "float32"
    return name


class _Ckpt:
    """orbax CheckpointManager over {"params": flat dict, "opt": leaves of the optimizer state}."""

    def __init__(self, path: Path):
        import orbax.checkpoint as ocp
        self.ocp = ocp
        self.mngr = ocp.CheckpointManager(path.absolute(), options=ocp.CheckpointManagerOptions(
            max_to_keep=2, enable_async_checkpointing=False))

    def latest(self) -> int | None:
        return self.mngr.latest_step()

    def save(self, step: int, params, opt_state) -> None:
        leaves = jax.tree.leaves(opt_state)
        tree = {"params": params, "opt": {f"{i:04d}": x for i, x in enumerate(leaves)}}
        self.mngr.save(step, args=self.ocp.args.StandardSave(tree), force=True)
        self.mngr.wait_until_finished()

    def restore(self, step: int, params, opt_state):
        """-> (params, opt_state) of checkpoint `step`, placed as the given ones are."""
        leaves, treedef = jax.tree.flatten(opt_state)
        like = {"params": params, "opt": {f"{i:04d}": x for i, x in enumerate(leaves)}}
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
        got = self.mngr.restore(step, args=self.ocp.args.StandardRestore(abstract))
        return got["params"], jax.tree.unflatten(treedef, [got["opt"][f"{i:04d}"] for i in range(len(leaves))])

    def close(self):
        self.mngr.close()


def _vocab(work: Path, shards, vocab_size: int, size: int, resume: bool, head_d2t=None):
    path = work / "vocab.npz"
    if resume and path.is_file():
        with np.load(path) as z:
            return z["d2t"], z["t2d"], float(z["covered"])
    if head_d2t is not None:  # the draft vocabulary of the head training continues from
        ids = np.asarray(head_d2t, np.int64) + np.arange(len(head_d2t))
        if len(ids) > vocab_size or ids.min() < 0 or ids.max() >= vocab_size or np.any(np.diff(ids) <= 0):
            raise ValueError("--init-head: its d2t does not map into the target vocabulary")
        if size is not None and size < len(ids):
            raise ValueError(f"--draft-vocab {size} is smaller than the --init-head's draft vocabulary "
                             f"({len(ids)}): a head's vocabulary can grow, not shrink")
        # the head's ids, and with a larger size the most frequent other labels (their lm_head columns
        # start as the target's: train() places the head's own columns)
        d2t, t2d, covered = dataset.draft_vocab(dataset.label_counts(shards, vocab_size), size or len(ids), ids)
    else:
        d2t, t2d, covered = dataset.draft_vocab(dataset.label_counts(shards, vocab_size), size or DRAFT_VOCAB)
    np.savez(path, d2t=d2t, t2d=t2d, covered=covered)
    return d2t, t2d, covered


def _vocab_text(s: dict) -> str:
    n, head = s["draft_vocab_size"], s.get("draft_vocab_from_head")
    if head is None:
        return f"{n} most frequent target predictions"
    if head == n:
        return f"{n} ids, the initial head's"
    return f"{n} ids: the initial head's {head} and the {n - head} most frequent other target predictions"


def _mean_metrics(ms: list[dict]) -> dict:
    host = jax.device_get(ms)
    out = {k: np.mean([np.asarray(m[k], np.float64) for m in host], axis=0) for k in host[0]}
    return {k: (v.tolist() if np.ndim(v) else float(v)) for k, v in out.items()}


def _widen_mlp(head: dict, params: dict, where: str) -> int:
    """Grow an initial head's MLP (in place in `head`) to the width of the fresh `params`: its units
    keep their weights, the new ones get the fresh gate / up columns and zero down-projection rows,
    so the widened head computes the same function until training moves them. -> units added."""
    have, want = head["mlp.w_gate"].shape[1], params["mlp.w_gate"].shape[1]
    if want < have:
        raise ValueError(f"--init-head {where}: its MLP has {have} units; --head-intermediate can widen it, "
                         f"not narrow it to {want}")
    if want == have:
        return 0
    for k in ("mlp.w_gate", "mlp.w_up"):
        head[k] = np.concatenate([np.asarray(head[k], np.float32), np.asarray(params[k], np.float32)[:, have:]], 1)
    down = np.asarray(head["mlp.w_down"], np.float32)
    head["mlp.w_down"] = np.concatenate([down, np.zeros((want - have, down.shape[1]), np.float32)], 0)
    return want - have


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) training; returns the summary (also written to WORK_DIR/summary.json)."""
    from specjax.checkpoint import load_flat
    t0 = time.perf_counter()
    work = Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = _Ckpt(work / "ckpt")
    start = ckpt.latest()
    if start is not None and not cfg.resume:
        raise ValueError(f"{work} already holds checkpoints (latest step {start}): pass resume=True "
                         "(--resume) or use another work directory")
    man, shards = load_shards(cfg.data_dir)
    model_dir = cfg.model_dir or man["model_dir"]
    target_hf = forward.read_hf_config(model_dir)
    tcfg, tflat = load_flat(model_dir, "float32")
    head, widened = None, 0
    if cfg.init_head:
        from specjax.checkpoint import load_draft_flat
        head, hcfg, _ = load_draft_flat(cfg.init_head, tcfg, "float32")
        if list(hcfg.aux_layers or ()) != [int(i) for i in man["aux_layers"]]:
            raise ValueError(f"--init-head {cfg.init_head}: aux layers {hcfg.aux_layers} differ from the "
                             f"data's {man['aux_layers']}")
    d2t, t2d, covered = _vocab(work, shards, tcfg.vocab_size, cfg.draft_vocab_size, cfg.resume,
                               None if head is None else head["d2t"])
    width = cfg.head_intermediate or (hcfg.layer.intermediate_size if head is not None else None)
    hf = forward.head_hf_config(target_hf, len(d2t), man["aux_layers"], width)
    ecfg = forward.head_config(hf, tcfg)
    dims = forward.HeadDims.of(ecfg)
    cdt = _compute_dtype(cfg.compute_dtype)
    lcfg = LossConfig(cfg.ttt_steps, cfg.decay, cdt)
    ocfg = OptConfig(cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr_ratio, cfg.weight_decay, cfg.clip)
    dp = DataParallel.over(cfg.devices)
    global_batch = dp.num_devices * cfg.batch_size
    packed, held = dataset.pack(shards, t2d, cfg.seq_len, cfg.seed).split(cfg.heldout)
    batches = dataset.Batches(packed, global_batch, cfg.seed, dp=dp)
    n_tok = int(sum(s["num_tokens"] for s in man["shards"]))
    _log(f"data: {man.get('num_seqs', '?')} seqs, {n_tok} tokens -> {packed.num_rows} rows x {cfg.seq_len} "
         f"({packed.nbytes / 2**30:.2f} GiB, {'on device' if batches.on_device else 'host'}); "
         f"{batches.steps_per_epoch:.1f} steps/epoch of {dp.num_devices} device(s) x {cfg.batch_size} rows; "
         f"draft vocab {len(d2t)} covers {covered:.1%} of labels; compute {cdt}; setup {time.perf_counter() - t0:.1f}s")
    embed = jax.device_put(jnp.asarray(tflat["embed"], cdt), dp.replicated)
    params = forward.init_params(ecfg, cfg.seed)
    if cfg.init_from_target:
        params.update(forward.target_init(tflat, d2t))
    if head is not None:
        head = dict(head)
        grown = len(d2t) - len(head["d2t"])
        if grown:  # the head's lm_head columns go to its ids' places in the grown vocabulary
            old_ids = np.asarray(head["d2t"], np.int64) + np.arange(len(head["d2t"]))
            at = np.searchsorted(np.asarray(d2t, np.int64) + np.arange(len(d2t)), old_ids)
            w = np.array(params["lm_head"], np.float32)
            w[:, at] = np.asarray(head["lm_head"], np.float32)
            head["lm_head"] = w
        widened = _widen_mlp(head, params, cfg.init_head)
        bad = {k for k in params if k not in head or tuple(head[k].shape) != tuple(params[k].shape)}
        if bad:
            raise ValueError(f"--init-head {cfg.init_head}: parameters missing or of other shapes: {sorted(bad)}")
        params.update({k: jnp.asarray(np.asarray(head[k], np.float32)) for k in params})
        _log(f"initialised from the head {cfg.init_head} (draft vocabulary {len(d2t)}"
             + (f", {grown} ids added, their lm_head columns the target's" if grown else "")
             + (f"; MLP widened by {widened} units, their down-projection rows zero: the same function)"
                if widened else ")"))
    tdims, aux_layers, target = None, tuple(int(i) for i in man["aux_layers"]), {}
    if packed.aux is None:  # token ids only: the step computes the target's features
        from specjax.train.target import TargetDims
        tdims = TargetDims.of(tcfg)
        target = jax.device_put({k: jnp.asarray(v, cdt) for k, v in tflat.items()}, dp.replicated)
        _log(f"features computed on the fly by the target (aux layers {aux_layers})")
    t2d_dev = jax.device_put(jnp.asarray(t2d), dp.replicated)
    del tflat
    params = {k: v.astype(cfg.param_dtype) for k, v in params.items()}
    opt_state = ocfg.optimizer().init(params)
    # committed to dp.replicated either way (fresh or restored): a restored, committed array would
    # otherwise miss the compiled step of an uncommitted one
    params, opt_state = jax.device_put((params, opt_state), dp.replicated)
    step = 0
    log_path = work / "train_log.jsonl"
    if start is not None:
        params, opt_state = ckpt.restore(start, params, opt_state)
        step = start
        _log(f"resumed from step {start}")
    _trim_log(log_path, step)
    fn = train_step_fn(dims, lcfg, ocfg, tdims, aux_layers, dp.replicated)
    evaluate = _heldout_eval(eval_step_fn(dims, lcfg, tdims, aux_layers), held, global_batch, dp, embed, target,
                             t2d_dev)
    sched = ocfg.schedule()
    bar = _bar(cfg, step)
    pending: list[dict] = []
    t_train = time.perf_counter()
    last = None
    saved = start
    stopped_early = False
    while step < cfg.steps:
        params, opt_state, m = fn(params, opt_state, embed, target, t2d_dev, batches.get(step))
        pending.append(m)
        step += 1
        bar.update(1)
        over_budget = cfg.time_budget is not None and time.perf_counter() - t_train > cfg.time_budget
        done = step == cfg.steps or (cfg.stop_at is not None and step >= cfg.stop_at) or over_budget
        if step % cfg.log_every == 0 or done:
            last = _mean_metrics(pending)
            pending = []
            last.update(step=step, lr=float(sched(step - 1)), elapsed=round(time.perf_counter() - t0, 2),
                        tau_est=tau_estimate(last["acc"]))
            if evaluate is not None and (step % cfg.eval_every == 0 or done):
                last["heldout"] = evaluate(params)
                _log(f"step {step}: held-out acc@k {last['heldout']['acc']} tau~{last['heldout']['tau_est']}")
            with open(log_path, "a") as f:
                f.write(json.dumps(last) + "\n")
            bar.set_postfix(loss=f"{last['total']:.3f}", acc0=f"{last['acc'][0]:.3f}", tau=f"{last['tau_est']:.2f}")
        if step % cfg.ckpt_every == 0 and step < cfg.steps:
            ckpt.save(step, params, opt_state)
            saved = step
        if done:
            stopped_early = step < cfg.steps
            if over_budget and stopped_early:
                _log(f"time budget {cfg.time_budget:.0f}s reached at step {step}")
            break
    bar.close()
    jax.block_until_ready(params)
    train_s = time.perf_counter() - t_train
    if saved != step:
        ckpt.save(step, params, opt_state)
    ckpt.close()
    from specjax.train.plot import plot_curves
    plot_curves(log_path, work / "curves.png")
    summary = {"step": step, "target_steps": cfg.steps, "stopped_early": stopped_early,
               "train_seconds": round(train_s, 1), "resumed_from": start,
               "tokens_per_step": global_batch * cfg.seq_len, "final": _final(log_path),
               "draft_vocab_size": len(d2t), "draft_vocab_coverage": covered,
               "draft_vocab_from_head": None if head is None else len(head["d2t"]),
               "mlp_width": int(hf["intermediate_size"]), "mlp_widened_by": widened,
               "data": {k: man.get(k) for k in ("prompt_files", "num_prompts", "num_seqs", "num_tokens",
                                                "temperatures", "max_tokens", "aux_layers", "dtype",
                                                "command", "complete")},
               "config": {**dataclasses.asdict(cfg), "compute_dtype": cdt, "devices": dp.num_devices},
               "model_dir": str(model_dir)}
    (work / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _log(f"{step} steps in {train_s:.1f}s ({(step - (start or 0)) / max(train_s, 1e-9):.2f} steps/s); "
         f"final {summary['final']}")
    if cfg.export_dir:
        export(params, d2t, hf, cfg.export_dir, cfg.export_dtype, summary, work, init_head=cfg.init_head)
    return summary


def _trim_log(path: Path, step: int) -> None:
    """Keep only log lines up to `step` (a resumed run rewrites what came after its checkpoint)."""
    if not path.is_file():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
    path.write_text("".join(ln + "\n" for ln in keep))


def _heldout_eval(fn, held, batch_size: int, dp: DataParallel, embed, target, t2d):
    """params -> held-out metrics {"loss": [K], "acc": [K] (acc@1..K: top-1 accuracy of draft step
    j), "tau_est", "tokens"} over all held-out rows (global batches; the last one wraps)."""
    if held is None:
        return None
    n = held.num_rows
    groups = [np.arange(i, i + batch_size) % n for i in range(0, n, batch_size)]
    dev = jax.device_put(held.arrays(), dp.replicated)
    take = dataset.take_fn(dp.batch)

    def evaluate(params) -> dict:
        ms = jax.device_get([fn(params, embed, target, t2d, take(dev, jnp.asarray(g))) for g in groups])
        cnt = np.sum([np.asarray(m["count"], np.float64) for m in ms], axis=0)
        acc = np.sum([np.asarray(m["acc"]) * np.asarray(m["count"]) for m in ms], axis=0) / np.maximum(cnt, 1)
        loss = np.sum([np.asarray(m["loss"]) * np.asarray(m["count"]) for m in ms], axis=0) / np.maximum(cnt, 1)
        return {"loss": np.round(loss, 4).tolist(), "acc": np.round(acc, 4).tolist(),
                "tau_est": round(tau_estimate(acc), 3), "tokens": int(cnt[0])}
    return evaluate


def _final(log_path: Path, last_n: int = 5) -> dict:
    rows = [json.loads(ln) for ln in log_path.read_text().splitlines() if ln.strip()] if log_path.is_file() else []
    if not rows:
        return {}
    held = [r["heldout"] for r in rows if "heldout" in r]
    rows = rows[-last_n:]
    acc = np.mean([r["acc"] for r in rows], axis=0).tolist()
    out = {"step": rows[-1]["step"], "loss": float(np.mean([r["total"] for r in rows])),
           "loss_per_step": np.round(np.mean([r["loss"] for r in rows], axis=0), 4).tolist(),
           "acc_per_step": np.round(acc, 4).tolist(), "tau_est": round(tau_estimate(acc), 3)}
    if held:
        out["heldout"] = held[-1]
    return out


def _bar(cfg: TrainConfig, initial: int):
    from specjax.train.data import _NoBar
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    if not cfg.progress:
        return _NoBar()
    return tqdm(total=cfg.steps, initial=initial, desc="train", unit="step", file=sys.stderr)


def export(params, d2t, hf: dict, out_dir: str | Path, dtype: str, summary: dict, work: Path | None = None,
           init_head: str | None = None) -> Path:
    """Write the head as a specjax draft directory (checkpoint.save_draft_dir) + TRAINING.md. A head
    continued from init_head keeps that head's tuned tree settings (specjax.json "spec_defaults",
    measured by scripts/tree_grid.py), marked as carried over, rather than falling back to a chain."""
    from specjax.checkpoint import MARKER, read_meta, save_draft_dir
    flat = {k: np.asarray(jax.device_get(v), np.float32) for k, v in params.items()}
    flat["d2t"] = np.asarray(d2t, np.int32)
    out = save_draft_dir(out_dir, flat, hf, dtype, source="specjax.train (EAGLE-3, training-time test)")
    prev = read_meta(init_head) if init_head else {}
    if "spec_defaults" in prev:
        meta = read_meta(out)
        meta["spec_defaults"] = prev["spec_defaults"]
        measured = dict(prev.get("spec_defaults_measured") or {})
        measured["carried_over_from"] = f"{init_head} (measured with that head, not this one)"
        meta["spec_defaults_measured"] = measured
        (out / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
    if work is not None and (work / "curves.png").is_file():
        shutil.copy(work / "curves.png", out / "curves.png")
    (out / "TRAINING.md").write_text(training_md(summary, dtype))
    _log(f"exported the head to {out}")
    return out


def _batch_text(c: dict) -> str:
    n = c.get("devices") or 1
    return f"{c['batch_size']}" if n == 1 else f"{n * c['batch_size']} ({n} devices x {c['batch_size']})"


def training_md(s: dict, dtype: str) -> str:
    c, d, f = s["config"], s["data"], s.get("final") or {}
    steps_line = " | ".join(f"{i}" for i in range(len(f.get("acc_per_step", []))))
    lines = [
        "# EAGLE-3 head: how it was trained", "",
        f"Target: `{s['model_dir']}`. Trained with specjax.train (JAX): training-time test over "
        f"{c['ttt_steps']} unrolled steps, loss weights {c['decay']}^j, labels = the target's greedy next "
        f"token; exported in {dtype}.", "",
        "## Commands", "",
        "```bash", *dict.fromkeys(x for x in (d.get("command"), c.get("command")) if x), "```", "",
        "## Data", "",
        f"- prompt files: {', '.join(d.get('prompt_files') or [])} ({d.get('num_prompts')} prompts used; "
        f"{'all chunks' if d.get('complete') else 'partial: time budget'})",
        f"- responses generated by the target ({d.get('dtype')}) at temperatures {d.get('temperatures')} "
        f"(one per prompt, in turn), max {d.get('max_tokens')} tokens"
        + (f"; {d['ignore_eos_share']:.0%} of the prompts drawn to run to the maximum past the end of the turn "
           "(EOS ignored)" if d.get("ignore_eos_share") else ""),
        f"- {d.get('num_seqs')} sequences, {d.get('num_tokens')} tokens; aux layers (inputs of) {d.get('aux_layers')}",
        f"- draft vocabulary: {_vocab_text(s)} (covering {s['draft_vocab_coverage']:.1%} of the training labels)",
        *([f"- MLP width {s['mlp_width']}: the initial head's grown by {s['mlp_widened_by']} units (zero "
           "down-projection rows at the start)"] if s.get("mlp_widened_by") else []),
        "",
        "## Training", "",
        f"- {s['step']} steps (of {s['target_steps']}{', stopped by the time budget' if s['stopped_early'] else ''}), "
        f"batch {_batch_text(c)} x {c['seq_len']} packed tokens, AdamW lr {c['lr']} (warmup {c['warmup']}, "
        f"cosine to {c['min_lr_ratio']} x), clip {c['clip']}, compute {c['compute_dtype']}; lm_head / final norm "
        f"{'initialised from the target' if c.get('init_from_target') else 'random'}",
        f"- {s['train_seconds']} s of training", "",
        "## Final metrics (mean of the last log entries)", "",
        f"| step j | {steps_line} |", "|---" * (len(f.get('acc_per_step', [])) + 1) + "|",
        "| loss | " + " | ".join(f"{x:.3f}" for x in f.get("loss_per_step", [])) + " |",
        "| top-1 acc (train) | " + " | ".join(f"{x:.3f}" for x in f.get("acc_per_step", [])) + " |",
        *(["| acc@k held-out | " + " | ".join(f"{x:.3f}" for x in f["heldout"]["acc"]) + " |"]
          if f.get("heldout") else []), "",
        f"Weighted loss {f.get('loss', float('nan')):.4f}; chain acceptance estimate from the accuracies "
        f"tau ~ {f.get('tau_est')} (train), {(f.get('heldout') or {}).get('tau_est')} (held-out: "
        f"{(f.get('heldout') or {}).get('tokens')} tokens never trained on); measure the real one with "
        "`specjax eval`.", "",
        "![curves](curves.png)", "",
    ]
    return "\n".join(lines)
