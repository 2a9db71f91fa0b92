"""Acceptance length (tau) and speed-up of speculative decoding over prompt sets; the same as
`specjax eval` (see specjax/eval.py). Example (GPU):

    python scripts/eval_acceptance.py --draft checkpoints/eagle3-smollm2-135m --limit 20 \
        --max-tokens 256 --json eval.json --markdown eval.md --png eval.png [--hf-baseline]
"""
from __future__ import annotations

import sys

from specjax.eval import main

if __name__ == "__main__":
    sys.exit(main())
