"""scripts/bench_datagen.py: offline generation throughput with refilled slots."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))


def test_bench_datagen_runs(tmp_path, capsys):
    """scripts/bench_datagen.py on a tiny model: fresh prompts per pass, one JSON row per pass."""
    import json
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tiny_dir import make_tiny_model_dir
    from bench_datagen import main
    d = tmp_path / "m"
    d.mkdir()
    make_tiny_model_dir(d, num_layers=1)
    prompts = tmp_path / "train.jsonl"
    prompts.write_text("".join(json.dumps({"question": " ".join(f"w{(i * 7 + j) % 90 + 3}" for j in range(3 + i % 9))}) + "\n"
                               for i in range(24)))
    out = tmp_path / "rows.jsonl"
    assert main(["--model", str(d), "--prompts", str(prompts), "--passes", "2", "--prompts-per-pass", "12",
                 "--batch", "8", "--max-tokens", "6", "--max-seq-len", "64", "--dtype", "float32",
                 "--json", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["pass"] for r in rows] == [0, 1] and all(r["prompts"] == 12 and r["tokens"] > 0 for r in rows)
    assert rows[0]["compiles"] > 0
