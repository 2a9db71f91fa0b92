"""Files shipped inside the specjax package (found the same way in a source checkout, after
`pip install .` and from a wheel):

  eagle3-smollm2-135m/   the EAGLE-3 head trained for the default model (TRAINING.md inside);
                         `specjax generate --speculate` uses it
  prompts/*.jsonl        the evaluation prompt sets (EAGLE / Spec-Bench format), one category each

A source checkout also reaches them at their historical places, checkpoints/eagle3-smollm2-135m and
data/prompts (symbolic links to these folders).
"""
from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
DEFAULT_HEAD_DIR = ASSETS_DIR / "eagle3-smollm2-135m"
PROMPTS_DIR = ASSETS_DIR / "prompts"
PROMPT_SETS = ("mt_bench", "gsm8k", "humaneval", "alpaca", "qa", "sum")


def prompt_file(name: str) -> Path:
    """The shipped prompt set `name` (one of PROMPT_SETS) as a path."""
    path = PROMPTS_DIR / f"{name}.jsonl"
    if not path.is_file():
        have = sorted(p.stem for p in PROMPTS_DIR.glob("*.jsonl"))
        raise FileNotFoundError(f"no shipped prompt set {name!r} in {PROMPTS_DIR} (have: {', '.join(have) or 'none'})")
    return path
