"""Host cost of one engine step's grammar masks (specjax.grammar_masks.MaskBuilder), by thread count,
against the per-row loop the engine used before (RequestGrammar.next_mask / tree_masks row by row
into a full [B, ...] buffer). Runs on the host CPU only (no model): use it to choose
SchedulerOptions(mask_threads=...) on a machine.

    python scripts/bench_grammar_masks.py                       # B = 1, 8, 32; threads 1, 2, 4, 8
    python scripts/bench_grammar_masks.py --batch 32 --threads 1,8 --nodes 5

Grammars: "any" (the permissive regex of bench_engine) and "json" (bench_engine's nested schema, the
matchers inside its first string value); trees: chains of `--nodes` nodes of ordinary text tokens.
Each figure is the best of --repeat calls (milliseconds per step).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_engine import JSON_SCHEMA  # noqa: E402

from specjax.grammar import GrammarCompiler  # noqa: E402
from specjax.grammar_masks import MaskBuilder  # noqa: E402


def best(fn, repeat: int) -> float:
    out = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument("--nodes", type=int, default=5, help="tree nodes (a chain: the root + num_steps drafts)")
    p.add_argument("--repeat", type=int, default=30)
    a = p.parse_args(argv)
    from specjax.checkpoint import load_tokenizer
    from specjax.default_model import ensure_default
    tok = load_tokenizer(ensure_default())
    vocab = 49152
    compiler = GrammarCompiler(tok, vocab)
    width = (vocab + 31) // 32
    text = tok.encode(" The lighthouse keeper walked slowly along the rocky shore at night", add_special_tokens=False)
    keys = {"any": ("regex", r"[\s\S]*"), "json": ("json_schema", json.dumps(JSON_SCHEMA))}
    prefixes = {"any": [], "json": tok.encode('{"title": "A', add_special_tokens=False)}
    tokens = np.array([0] + text[: a.nodes - 1], np.int32)
    parents = np.arange(-1, a.nodes - 1, dtype=np.int32)
    print(f"{'grammar':8} {'B':>3} {'threads':>7} {'next: rows':>10} {'builder':>8} {'tree: rows':>10} {'builder':>8}  (ms)")
    for name, key in keys.items():
        for B in (int(b) for b in a.batch.split(",")):
            grammars = [compiler.matcher(key, [tok.eos_token_id]) for _ in range(B)]
            for g in grammars:
                g.accept(prefixes[name])
            tokens[0] = prefixes[name][-1] if prefixes[name] else 0

            def rows_next():
                m = np.full((B, width), -1, np.int32)
                for b, g in enumerate(grammars):
                    g.next_mask(m[b])

            def rows_tree():
                m = np.full((B, a.nodes, width), -1, np.int32)
                for b, g in enumerate(grammars):
                    m[b] = g.tree_masks(tokens, parents)

            old_next, old_tree = best(rows_next, a.repeat), best(rows_tree, a.repeat)
            for th in (int(t) for t in a.threads.split(",")):
                mb = MaskBuilder(width, th)
                nxt = best(lambda: mb.next_masks(list(enumerate(grammars)), B), a.repeat)
                tree = best(lambda: mb.tree_masks([(b, g, (tokens, parents)) for b, g in enumerate(grammars)], B),
                            a.repeat)
                print(f"{name:8} {B:>3} {th:>7} {old_next:>10.3f} {nxt:>8.3f} {old_tree:>10.3f} {tree:>8.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
