"""XLA's GEMM choices tuned in context: several fresh compilations of one engine, each timed as it runs, the
fastest kept (GPU).

XLA's GEMM autotuner times each candidate tiling of a GEMM fusion alone and keeps the fastest; for the small
GEMMs of a batch-1 step (SmolLM2: 2.5-6 µs each) candidates whose times lie close in isolation might differ
inside the program. Profiles of the same code on H100s had suggested so (the verify's gate|up GEMM 4.58 or
6.0 µs per call, its down GEMM 3.14 or 3.65 µs), but profile times are attributions under programmatic
dependent launch; measured as this script measures (docs/benchmarks.md, "GEMM picks and long prompts"), three
fresh compilations of the speculative engine ran 1 263.9-1 269.4 µs of wall per fused step and two of plain
decoding 960.8-964.6 µs per step: a spread of 0.4 %, not the profiles' 3 %. With the persistent compilation
cache on (specjax.compile_cache), XLA keeps its picks per fusion in `<cache>/xla_gpu_per_fusion_autotune_cache_dir`,
so a machine keeps the first picks it made.

This script compiles the engine `--trials` times, each in a process of its own with an empty cache directory
(every GEMM autotuned afresh), times its steady state (`LLM.generate` of `--prompts` short prompts at batch 1,
`--max-tokens` tokens, EOS ignored: wall per decode step, the best of `--reps` runs after a warm-up), and
prints each trial's figure. `--install` copies the fastest trial's autotune results into the cache directory
that `specjax` uses ($SPECJAX_COMPILE_CACHE / $SPECJAX_HOME/jax-cache) and removes the compiled executables
there (they hold the earlier picks), so the next start compiles once more, reading the kept picks. Run it once
per engine (`--engine plain`, `--engine spec`): their step programs have GEMM fusions of their own.

    python3 scripts/tune_autotune.py --engine spec --trials 4 [--install]
    python3 scripts/tune_autotune.py --engine plain --trials 4 [--install]

On a CPU XLA writes no autotune results: the trials run and are timed, nothing is installed. (`--install` is
tested on the CPU with nested result files; on a GPU its first version found none: XLA nests them.)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
AUTOTUNE_DIR = "xla_gpu_per_fusion_autotune_cache_dir"  # jax's name inside its cache directory


def child(a) -> int:
    """One trial: compile the engine with the cache directory a.cache_dir, time it, write a.out."""
    os.environ["SPECJAX_COMPILE_CACHE"] = a.cache_dir  # before specjax turns the cache on
    sys.path.insert(0, str(REPO))
    import jax

    from specjax import LLM, SamplingParams
    from specjax.assets import DEFAULT_HEAD_DIR, PROMPTS_DIR
    draft = None if a.engine == "plain" else (a.draft or str(DEFAULT_HEAD_DIR))
    llm = LLM(a.model, dtype=a.dtype, max_batch=1, draft=draft)
    with open(PROMPTS_DIR / "mt_bench.jsonl") as fh:
        texts = [json.loads(line)["turns"][0] for line in list(fh)[: a.prompts]]
    prompts = [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, params)  # compiles (GEMMs autotuned afresh: the cache directory is empty)
    llm.engine.background.wait()
    compile_s = time.perf_counter() - t0
    best = None
    for _ in range(a.reps):
        s0 = llm.engine.stats()
        t = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - t
        s1 = llm.engine.stats()
        steps = sum(s1[k] - s0[k] for k in s1 if k.endswith("_dispatch_steps"))
        if steps and (best is None or wall / steps < best["us_per_step"] / 1e6):
            best = {"us_per_step": wall / steps * 1e6, "wall_s": wall, "steps": steps}
    files = [p for p in (Path(a.cache_dir) / AUTOTUNE_DIR).rglob("*") if p.is_file()] if a.cache_dir else []
    Path(a.out).write_text(json.dumps({**(best or {}), "compile_s": compile_s, "autotune_files": len(files),
                                       "device": jax.devices()[0].device_kind}))
    return 0


def pick(results: list[dict]) -> int | None:
    """Index of the fastest trial (lowest µs per step) among those that ran; None when none did."""
    ok = [i for i, r in enumerate(results) if r.get("us_per_step")]
    return min(ok, key=lambda i: results[i]["us_per_step"]) if ok else None


def install(trial_dir: Path, cache_dir: Path) -> tuple[int, int]:
    """Copy the trial's autotune results (files at any depth of its autotune directory: XLA nests them) into
    cache_dir's, same paths replaced, and remove the compiled executables of cache_dir (the files beside the
    autotune directory). -> (files copied, files removed)."""
    src = trial_dir / AUTOTUNE_DIR
    dst = cache_dir / AUTOTUNE_DIR
    files = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else []
    if not files:
        return 0, 0
    for p in files:
        out = dst / p.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, out)
    removed = 0
    for p in cache_dir.iterdir():
        if p.is_file():
            p.unlink()
            removed += 1
    return len(files), removed


def target_cache_dir() -> Path | None:
    """The directory specjax's compile cache uses in this environment (specjax.compile_cache), None when off."""
    sys.path.insert(0, str(REPO))
    from specjax.compile_cache import ENV, OFF, default_dir
    choice = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.environ.get(ENV, "").strip()
    if choice.lower() in OFF:
        return None
    return Path(choice).expanduser() if choice else default_dir()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("spec", "plain"), default="spec")
    ap.add_argument("--model", default=None, help="model directory (default: the default model)")
    ap.add_argument("--draft", default=None, help="draft directory for --engine spec (default: the shipped head)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--install", action="store_true", help="keep the fastest trial's picks in specjax's cache")
    ap.add_argument("--json", help="write every trial's figures here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a)
    for name in ("trials", "prompts", "max_tokens", "reps"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    work = Path(tempfile.mkdtemp(prefix="specjax_tune_"))
    results = []
    for i in range(a.trials):
        d = work / f"trial{i}"
        d.mkdir()
        out = work / f"trial{i}.json"
        cmd = [sys.executable, __file__, "--child", "--engine", a.engine, "--dtype", a.dtype, "--prompts",
               str(a.prompts), "--max-tokens", str(a.max_tokens), "--reps", str(a.reps), "--cache-dir", str(d),
               "--out", str(out)] + (["--model", a.model] if a.model else []) + (["--draft", a.draft] if a.draft else [])
        rc = subprocess.call(cmd)
        r = json.loads(out.read_text()) if rc == 0 and out.exists() else {"error": f"trial exited with {rc}"}
        results.append(r)
        print(f"trial {i}: " + (f"{r['us_per_step']:.1f} us per step ({r['steps']} steps, compile {r['compile_s']:.1f} s, "
                                f"{r['autotune_files']} autotune results)" if r.get("us_per_step") else str(r)),
              flush=True)
    best = pick(results)
    if best is None:
        print("no trial ran", file=sys.stderr)
        return 1
    times = [r["us_per_step"] for r in results if r.get("us_per_step")]
    print(f"{a.engine}: fastest trial {best} at {times and min(times):.1f} us per step; slowest {max(times):.1f} "
          f"(+{100 * (max(times) / min(times) - 1):.1f} %)", flush=True)
    summary = {"engine": a.engine, "trials": results, "best": best}
    if a.install:
        target = target_cache_dir()
        if target is None:
            print("--install: specjax's compile cache is off ($SPECJAX_COMPILE_CACHE); nothing installed")
        else:
            copied, removed = install(work / f"trial{best}", target)
            summary.update(installed=copied, removed_executables=removed, cache_dir=str(target))
            print(f"--install: {copied} autotune results of trial {best} into {target / AUTOTUNE_DIR}; "
                  f"{removed} compiled executables removed (the next start compiles with these picks)"
                  if copied else "--install: the trial wrote no autotune results (not a GPU?); nothing installed")
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
