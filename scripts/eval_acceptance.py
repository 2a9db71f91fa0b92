"""Acceptance length (tau) and speed-up of speculative decoding over prompt sets; the same as
`specjax eval` (see specjax/eval.py). Example (GPU):

    python scripts/eval_acceptance.py --limit 20 --max-tokens 256 \
        --json eval.json --markdown eval.md --png eval.png [--hf-baseline]     # the shipped head
    python scripts/eval_acceptance.py --speculate ngram --limit 20 --max-tokens 256 \
        --json ngram.json --markdown ngram.md --hf-baseline                   # n-gram vs HF prompt lookup
"""
from __future__ import annotations

import sys

from specjax.eval import main

if __name__ == "__main__":
    sys.exit(main())
