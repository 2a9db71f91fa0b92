"""Device time of one sampling call (specjax.sampling.sample) per program kind and batch size:
greedy (no sort), UNFILTERED (temperature only: Gumbel-max in vocabulary order, no sort) and the
general program (top-k / top-p: a [B, V] sort finds each row's cut-off).

    python scripts/bench_sampling.py --batches 1,64,512,1024 --vocab 49152
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,64,512,1024")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.sampling import UNFILTERED, SamplingArrays, sample

    print(f"device {jax.devices()[0].device_kind}, vocab {a.vocab}")
    print("| batch | greedy ms | temperature only ms | top-p 0.9 ms |")
    print("|---|---|---|---|")
    for b in (int(x) for x in a.batches.split(",")):
        logits = jnp.asarray(np.random.default_rng(0).normal(0, 3, (b, a.vocab)).astype(np.float32))
        pos = jnp.arange(b, dtype=jnp.int32)
        row = []
        for mode, top_p in ((False, 1.0), (UNFILTERED, 1.0), (True, 0.9)):
            samp = SamplingArrays(jnp.full((b,), 0.8, jnp.float32), jnp.full((b,), top_p, jnp.float32),
                                  jnp.zeros((b,), jnp.int32), jnp.arange(b, dtype=jnp.uint32))
            fn = jax.jit(lambda lg, s, p, m=mode: sample(lg, s, p, m))
            fn(logits, samp, pos).block_until_ready()
            t0 = time.perf_counter()
            for i in range(a.iters):
                out = fn(logits, samp, pos + i)
            out.block_until_ready()
            row.append((time.perf_counter() - t0) / a.iters * 1e3)
        print(f"| {b} | {row[0]:.3f} | {row[1]:.3f} | {row[2]:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
