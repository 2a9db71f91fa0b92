"""Train an EAGLE-3 head for a specjax model (thin CLI over specjax.train).

    # 1. data: target responses to training prompts + the target's features, as shards
    python scripts/train_eagle.py data --prompts data/train/gsm8k_train.jsonl --out runs/e3/data \
        [--model DIR] [--max-prompts N] [--temperatures 0,0.7,1.0] [--max-tokens 256] [--time-budget S]
    # 2. train (resumable) and export a draft directory usable as `specjax generate --draft OUT`
    python scripts/train_eagle.py train --data runs/e3/data --work runs/e3/work --export OUT \
        [--steps N] [--batch-size B] [--seq-len T] [--ttt-steps K] [--draft-vocab V] [--head-intermediate F] [--resume]
    # both: `all` takes the options of the two (--skip-data reuses existing shards)
    # 0. prompts beyond GSM8K: written by the target itself + tasks over installed Python text
    python scripts/train_eagle.py prompts --out runs/e3/prompts.jsonl [--self-instruct N] [--passages N]
    # prompts and data on N GPUs: --workers N (process i on GPU i, each a share of the work, then
    # joined); train uses all local devices data-parallel (--devices N: the first N)

Evaluation prompt sets (data/prompts/, *test* files) are refused as training data.
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path


def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x.strip())


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def add_data_args(p):
    p.add_argument("--prompts", nargs="+", required=True, help="training prompt jsonl files")
    p.add_argument("--out", required=True, help="data directory (shards + manifest.json)")
    p.add_argument("--model", default=None, help="converted target model dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="target dtype")
    p.add_argument("--temperatures", type=_floats, default=(0.0, 0.7, 1.0), help="e.g. 0,0.7,1.0 (one per prompt)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--ignore-eos-share", type=float, default=0.0, metavar="F",
                   help="share of the prompts whose responses run to --max-tokens past the end of the turn "
                        "(EOS ignored; drawn per prompt from --data-seed)")
    p.add_argument("--max-prompts", type=int, default=None)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--max-batch", type=int, default=128, help="generation batch (engine slots)")
    p.add_argument("--chunk-prompts", type=int, default=1024, help="prompts per shard")
    p.add_argument("--tokens-per-batch", type=int, default=16384, help="feature prefill batch (tokens)")
    p.add_argument("--aux-layers", type=_ints, default=None, help="default: 2,L//2,L-3")
    p.add_argument("--raw", action="store_true", help="no chat template")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--data-time-budget", type=float, default=None, help="seconds; stop after the current chunk")
    p.add_argument("--no-features", action="store_true",
                   help="store token ids only; training computes the target's features on the fly")


def add_worker_args(p, what: str):
    p.add_argument("--workers", type=int, default=1,
                   help=f"{what} in N processes, process i on GPU i (CUDA_VISIBLE_DEVICES), then joined")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # set for each of them


def add_prompt_args(p):
    p.add_argument("--out", required=True, help="jsonl to write")
    p.add_argument("--model", default=None, help="converted target model dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--self-instruct", type=int, default=40000, help="user messages written by the target")
    p.add_argument("--passages", type=int, default=40000, help="task prompts over installed Python text")
    p.add_argument("--schemas", type=int, default=0,
                   help="prompts with random JSON schemas (their responses generated under the schema)")
    p.add_argument("--max-batch", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)


def add_train_args(p, data_required=True):
    if data_required:
        p.add_argument("--data", required=True, help="data directory made by `data`")
    p.add_argument("--work", required=True, help="work dir: checkpoints, logs, curves")
    p.add_argument("--export", default=None, help="write the trained head here (a specjax draft directory)")
    p.add_argument("--train-model", default=None, help="target dir (default: the one the data was made with)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=8, help="rows per device (a step: devices x this)")
    p.add_argument("--devices", type=int, default=None, help="data parallel over the first N local devices "
                   "(default: all)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--ttt-steps", type=int, default=6, help="unrolled draft steps (training-time test)")
    p.add_argument("--decay", type=float, default=0.8, help="loss weight of step j: decay**j")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="draft vocabulary size (default 16384; with --init-head: that head's; larger: the "
                        "head's vocabulary grown by the most frequent other labels)")
    p.add_argument("--no-target-init", action="store_true",
                   help="random lm_head / final norm (default: start from the target's)")
    p.add_argument("--init-head", default=None,
                   help="continue training an exported head (its weights and its draft vocabulary)")
    p.add_argument("--head-intermediate", type=int, default=None,
                   help="the head's MLP width (default: --init-head's, else the target's; wider than the "
                        "initial head's: its MLP grown by units that start with zero output weights)")
    p.add_argument("--ckpt-every", type=int, default=200)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--heldout", type=float, default=0.01, help="share of packed rows held out (acc@k)")
    p.add_argument("--eval-every", type=int, default=200, help="steps between held-out evaluations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compute-dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--param-dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--time-budget", type=float, default=None, help="seconds of training, then checkpoint + export")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step (resume later)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --work")
    p.add_argument("--no-progress", action="store_true")


def run_workers(argv: list[str], n: int) -> None:
    """Run this command as n processes, process i with --worker i on the i-th visible GPU
    (CUDA_VISIBLE_DEVICES); the first one that fails stops the others."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [g for g in visible.split(",") if g.strip()] if visible is not None else [str(i) for i in range(n)]
    if len(gpus) < n:
        raise SystemExit(f"--workers {n}: CUDA_VISIBLE_DEVICES={visible} lists {len(gpus)} GPU(s)")
    script = str(Path(__file__).resolve())
    procs = [subprocess.Popen([sys.executable, script, *argv, "--worker", str(i)],
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": gpus[i]}) for i in range(n)]
    while any(p.poll() is None for p in procs):
        if any(p.returncode for p in procs):
            break
        time.sleep(1)
    bad = [i for i, p in enumerate(procs) if p.returncode]
    for p in procs:
        if p.poll() is None:
            p.terminate()
        p.wait()
    if bad:
        raise SystemExit(f"worker {bad[0]} of {n} failed (exit {procs[bad[0]].returncode})")


def run_data(a, command: str) -> dict:
    from specjax.train.data import DataConfig, build_data
    cfg = DataConfig(prompt_files=a.prompts, out_dir=a.out, model_dir=a.model, dtype=a.dtype,
                     temperatures=a.temperatures, max_tokens=a.max_tokens, max_prompts=a.max_prompts,
                     ignore_eos_share=a.ignore_eos_share,
                     max_seq_len=a.max_seq_len, max_batch=a.max_batch, chunk_prompts=a.chunk_prompts,
                     tokens_per_batch=a.tokens_per_batch, aux_layers=a.aux_layers, chat=not a.raw,
                     seed=a.data_seed, time_budget=a.data_time_budget, features=not a.no_features,
                     progress=not getattr(a, "no_progress", False) and getattr(a, "worker", None) is None,
                     command=command, worker=getattr(a, "worker", None) or 0, workers=getattr(a, "workers", 1))
    return build_data(cfg)


def run_prompts(a) -> None:
    """Worker i of N (--worker): its share of each kind, into OUT.part-i; the run of N workers
    (--workers N) joins their parts into OUT."""
    from specjax.train import prompts
    t0 = time.perf_counter()
    i, n = (a.worker or 0), a.workers
    out = a.out if a.worker is None else f"{a.out}.part-{i}"
    if a.worker is None and n > 1:
        parts = [f"{a.out}.part-{j}" for j in range(n)]
        rows = [r for f in parts for r in prompts.read_jsonl(f)]
    else:
        n_pass, _ = prompts.worker_share(a.passages, a.seed, i, n)
        rows = prompts.passage_prompts(n_pass, seed=a.seed, part=(i, n)) if n_pass else []
        if n_pass:  # (the self-instruct process of train_default_head.sh asks for none)
            print(f"[prompts] {len(rows)} passage prompts in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        n_schemas, seed = prompts.worker_share(a.schemas, a.seed, i, n)
        if n_schemas:
            from specjax.train.schemas import schema_prompts
            rows += schema_prompts(n_schemas, seed=seed)
        n_self, seed = prompts.worker_share(a.self_instruct, a.seed, i, n)
        if n_self:
            from specjax import LLM
            llm = LLM(a.model, dtype=a.dtype, max_batch=a.max_batch, max_seq_len=256)
            rows += prompts.self_instruct(llm, n_self, seed=seed)
    random.Random(a.seed).shuffle(rows)
    prompts.write_jsonl(rows, out)
    if a.worker is None and n > 1:
        for f in parts:
            Path(f).unlink()
    kinds = collections.Counter(r["source"].split(":")[0] for r in rows)
    print(f"[prompts] wrote {len(rows)} prompts to {out} ({dict(kinds)}) in {time.perf_counter() - t0:.1f}s",
          file=sys.stderr)


def run_train(a, data_dir: str, command: str) -> dict:
    from specjax.train.trainer import TrainConfig, train
    cfg = TrainConfig(data_dir=data_dir, work_dir=a.work, export_dir=a.export, model_dir=a.train_model,
                      steps=a.steps, batch_size=a.batch_size, devices=a.devices, seq_len=a.seq_len, lr=a.lr,
                      warmup=a.warmup, min_lr_ratio=a.min_lr_ratio, weight_decay=a.weight_decay, clip=a.clip,
                      ttt_steps=a.ttt_steps, decay=a.decay, draft_vocab_size=a.draft_vocab,
                      init_from_target=not a.no_target_init, init_head=a.init_head, head_intermediate=a.head_intermediate,
                      ckpt_every=a.ckpt_every, log_every=a.log_every, heldout=a.heldout,
                      eval_every=a.eval_every, seed=a.seed, compute_dtype=a.compute_dtype,
                      param_dtype=a.param_dtype, export_dtype=a.export_dtype, time_budget=a.time_budget,
                      stop_at=a.stop_at, resume=a.resume, progress=not a.no_progress, command=command)
    return train(cfg)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = "python scripts/train_eagle.py " + " ".join(shlex.quote(x) for x in argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prompts", help="build training prompts (self-instruct + passages)")
    add_prompt_args(pp)
    add_worker_args(pp, "write the prompts")
    dp = sub.add_parser("data", help="generate responses and record target features")
    add_data_args(dp)
    add_worker_args(dp, "generate the chunks")
    add_train_args(sub.add_parser("train", help="train (or resume) and export"))
    both = sub.add_parser("all", help="data, then train")
    add_data_args(both)
    add_train_args(both, data_required=False)
    both.add_argument("--skip-data", action="store_true", help="reuse the shards in --out as they are")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    if a.cmd in ("prompts", "data") and a.worker is None and a.workers > 1:
        if a.cmd == "data":
            from specjax.train.data import merge_manifests
            merge_manifests(a.out)  # the parts of an interrupted parallel run first
        run_workers(argv, a.workers)
    if a.cmd == "prompts":
        run_prompts(a)
        return 0
    if a.cmd in ("data", "all"):
        from specjax.train.data import load_manifest
        if a.cmd == "all" and a.skip_data and load_manifest(a.out):
            print(f"[data] skipped: reusing {a.out}", file=sys.stderr)
        elif a.cmd == "data" and a.worker is None and a.workers > 1:
            from specjax.train.data import merge_manifests
            man = merge_manifests(a.out, command)
            print(f"[data] joined {a.workers} workers: {man['num_seqs']} sequences, {man['num_tokens']} tokens in "
                  f"{len(man['shards'])} shards ({'complete' if man['complete'] else 'partial'})", file=sys.stderr)
        else:
            run_data(a, command)
        print(f"[data] stage done at {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    if a.cmd in ("train", "all"):
        run_train(a, a.data if a.cmd == "train" else a.out, command)
        print(f"[train] stage done at {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
