"""A converted model directory with random weights of a named shape (specjax.shapes) and a real model's
tokenizer, chat template and EOS: for serving / generation benchmarks of larger models than the default
one, where no checkpoint can be downloaded. The text it writes is noise; its timing is a real model's.

    python scripts/make_random_model.py --shape llama3.1-8b --out /tmp/rand8b            # the default model's tokenizer
    python scripts/make_random_model.py --shape tiny --tokenizer-from DIR --out DIR2 --dtype float32

The vocabulary is the tokenizer model's (vocab_size and eos_token_id are taken from its config.json);
every other field comes from the shape. Weights: N(0, 0.02) drawn on the default JAX device (fast on a
GPU), norms 1; written with specjax.checkpoint.save_model_dir, so `specjax serve --model OUT`,
`LLM(OUT)` and the benchmarks' --model take it.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specjax.checkpoint import DTYPES, check_converted, dtype_name, save_model_dir  # noqa: E402
from specjax.config import ModelConfig  # noqa: E402
from specjax.convert.hf import TOKENIZER_FILES  # noqa: E402
from specjax.models.llama import param_specs  # noqa: E402
from specjax.shapes import SHAPES  # noqa: E402

KEPT_FROM_TOKENIZER_MODEL = ("vocab_size", "eos_token_id", "bos_token_id")


def random_hf_config(shape: str, tok_config: dict) -> dict:
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    hf = dict(SHAPES[shape])
    hf.update({k: tok_config[k] for k in KEPT_FROM_TOKENIZER_MODEL if k in tok_config})
    return hf


def random_flat(cfg: ModelConfig, dtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    """{name: host array}: matrices N(0, 0.02), vectors (norms) 1."""
    jdt = jnp.dtype(DTYPES[dtype])
    key = jax.random.PRNGKey(seed)
    flat = {}
    for i, (name, (shape, _)) in enumerate(sorted(param_specs(cfg).items())):
        if len(shape) == 1:
            flat[name] = np.ones(shape, jdt)
        else:
            w = 0.02 * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
            flat[name] = np.asarray(w.astype(jdt))
    return flat


def make_random_model(shape: str, tokenizer_from: str | Path, out: str | Path, dtype: str = "bfloat16",
                      seed: int = 0) -> Path:
    src = check_converted(tokenizer_from, what="model")
    hf = random_hf_config(shape, json.loads((src / "config.json").read_text()))
    cfg = ModelConfig.from_hf_dict(hf)
    flat = random_flat(cfg, dtype_name(dtype), seed)
    out = save_model_dir(out, flat, hf, dtype_name(dtype), source=f"random weights, shape {shape}, seed {seed}")
    for n in TOKENIZER_FILES + ("generation_config.json",):
        if (src / n).is_file():
            shutil.copyfile(src / n, out / n)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, help=f"one of {sorted(SHAPES)}")
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer-from", default=None, help="a converted model dir (default: the default model)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    src = a.tokenizer_from
    if src is None:
        from specjax.default_model import ensure_default
        src = ensure_default()
    t0 = time.perf_counter()
    out = make_random_model(a.shape, src, a.out, a.dtype, a.seed)
    meta = json.loads((out / "specjax.json").read_text())
    print(f"{out}: {a.shape}, {meta['num_params'] / 1e9:.2f} B parameters, {a.dtype}, "
          f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
