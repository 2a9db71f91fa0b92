"""What one prompt's prefill costs through LLM.generate (GPU), per paged-attention implementation:
generate(max_tokens=1) of one random N-token prompt (prefix cache off), median and min of 10 timed
calls after two warm-up calls. The difference between N and a short prompt is the prefill's own
cost; the short prompt's time is the fixed part (admission, one prefill dispatch, reading the token).

    python scripts/probe_prefill.py                               # mosaic_gpu,cudnn,reference; 32,1000,2048
    python scripts/probe_prefill.py --attention reference --lengths 16,64 --dtype float32   # CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specjax import LLM, SamplingParams  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="converted model dir (default: the default model)")
    p.add_argument("--attention", default="mosaic_gpu,cudnn,reference")
    p.add_argument("--lengths", default="32,1000,2048")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    rows, failed = [], []
    for attn in a.attention.split(","):
        try:
            llm = LLM(a.model, dtype=a.dtype, max_batch=1, max_seq_len=a.max_seq_len, attention=attn,
                      prefix_cache=False)
        except Exception as e:  # noqa: BLE001 - an implementation this machine lacks: said, then the next
            print(f"{attn}: failed to start: {type(e).__name__}: {e}", flush=True)
            failed.append(attn)
            continue
        rng = np.random.default_rng(0)
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        for n in (int(x) for x in a.lengths.split(",")):
            ids = [int(x) for x in rng.integers(100, min(40000, llm.cfg.vocab_size), n)]
            for _ in range(2):
                llm.generate([ids], params)
            ts = []
            for _ in range(a.iters):
                t = time.perf_counter()
                llm.generate([ids], params)
                ts.append(time.perf_counter() - t)
            r = dict(attn=attn, n=n, ms_median=1e3 * float(np.median(ts)), ms_min=1e3 * min(ts))
            print(json.dumps(r), flush=True)
            rows.append(r)
        del llm
    if a.json:
        Path(a.json).write_text(json.dumps(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
