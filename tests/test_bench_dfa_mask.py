"""scripts/bench_dfa_mask.py: the device-DFA ops and the fused program with and without a DFA row."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))


def test_bench_dfa_mask_runs(tmp_path, capsys):
    """A CPU smoke run on the tiny shape: the ops rows (old / packed / bit-row masks agree, checked
    inside), tree_states rows, and one program row with every variant, each traced with its own ops
    (the old tree_states adds a device loop; the library's has none)."""
    from bench_dfa_mask import VARIANTS, main
    out = tmp_path / "rows.jsonl"
    assert main(["--shape", "tiny", "--dtype", "float32", "--iters", "1", "--batches", "2", "--nodes", "1,5",
                 "--vocab", "512", "--draft-vocab", "170", "--states", "16", "--classes", "32",
                 "--max-seq-len", "128", "--context", "16", "--json", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    ops = [r for r in rows if r["part"] == "ops"]
    assert {(r["nodes"], r["vocab"]) for r in ops} == {(1, 512), (5, 512), (1, 170), (5, 170)}
    assert all(r["packed_ms"] > 0 and r["gather_ms"] > 0 and r["flat_ms"] > 0 for r in ops)
    assert {r["nodes"] for r in rows if r["part"] == "tree_states"} == {2, 5}
    prog, = [r for r in rows if r["part"] == "program"]
    assert all(prog[f"{name}_ms"] > 0 for name, _, _ in VARIANTS) and prog["base"] == "none"
    loops = {name: int(prog[f"{name}_hlo"].split()[0]) for name, _, _ in VARIANTS}
    assert loops["old"] == loops["off"] + 1 == loops["new_mask_only"]
    assert loops["new"] == loops["off"] == loops["none"] == loops["new_tree_only"] == loops["flat"] == loops["bitrows"]
    assert "fused speculative program" in capsys.readouterr().out
