"""specjax.eval without a model: the shipped prompt sets load, the summary renders as a markdown
table and a PNG, the CLI parses `specjax eval` and refuses --hf-baseline without a GGUF before
loading anything. (A real `specjax eval` run with a trained head: tests/test_train.py.)"""
from __future__ import annotations

import json

import pytest

from specjax import cli
from specjax import eval as spec_eval


def test_shipped_prompt_sets():
    sets = spec_eval.load_sets(limit=3)
    assert list(sets) == list(spec_eval.DEFAULT_SETS)
    assert all(len(v) == 3 and all(isinstance(t, str) and t for t in v) for v in sets.values())
    full = spec_eval.load_sets([str(spec_eval.PROMPTS_DIR / "mt_bench.jsonl")])
    assert len(full["mt_bench"]) == 80 and full["mt_bench"][0].startswith("Compose an engaging travel blog")


def test_prompt_file_formats(tmp_path):
    f = tmp_path / "mine.v2.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in ({"turns": ["a", "b"]}, {"prompt": "c"}, {"question": "d"})))
    assert spec_eval.load_sets([str(f)]) == {"mine": ["a", "c", "d"]}
    bad = tmp_path / "empty.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="no prompts"):
        spec_eval.load_sets([str(bad)])


def _summary(hf=False):
    def cat(tau, sp):
        return {"prompts": 2, "tokens_plain": 100, "tokens_spec": 100, "seconds_plain": 1.0, "seconds_spec": 1.0 / sp,
                "tok_s_plain": 100.0, "tok_s_spec": 100.0 * sp, "tau": tau, "spec_steps": 40,
                "tau_per_prompt": [tau - 0.1, tau + 0.1], "identical": 2, "speedup": sp}
    s = {"settings": {"model": "m", "draft": "checkpoints/head", "method": "eagle3", "num_steps": 4, "topk": 1,
                      "num_draft_tokens": 4, "max_batch": 1, "max_tokens": 64, "dtype": "bfloat16",
                      "chat": True, "device": "cpu", "backend": "cpu"},
         "categories": {"mt_bench": cat(2.5, 1.8), "gsm8k": cat(3.0, 2.1)}, "overall": cat(2.75, 1.95)}
    s["overall"]["prompts"] = 4
    if hf:
        s["hf"] = {"categories": {"mt_bench": {"tok_s": 40.0}, "gsm8k": {"tok_s": 50.0}}, "overall": {"tok_s": 45.0}}
    return s


def test_markdown_and_plot(tmp_path):
    md = spec_eval.markdown(_summary())
    assert "| mt_bench | 2 | 2.50 | 100.0 | 180.0 | 1.80x | 2/2 |" in md
    assert "| **overall** | 4 | 2.75 |" in md and "HF" not in md
    md = spec_eval.markdown(_summary(hf=True))
    assert "| gsm8k | 2 | 3.00 | 100.0 | 210.0 | 2.10x | 2/2 | 50.0 | 2.0x | 4.2x |" in md
    png = spec_eval.plot(_summary(), tmp_path / "e.png")
    assert png.stat().st_size > 1000


def test_cli_eval_arguments(tmp_path, capsys):
    a = cli.build_parser().parse_args(["eval", "--draft", "d", "--limit", "2", "--prompts", "x.jsonl", "y.jsonl",
                                       "--num-steps", "5", "--topk", "2", "--max-batch", "4", "--json", "o.json"])
    assert (a.draft, a.limit, a.prompts, a.num_steps, a.topk, a.max_batch, a.fn) == (
        "d", 2, ["x.jsonl", "y.jsonl"], 5, 2, 4, spec_eval.cmd_eval)
    rc = cli.main(["eval", "--draft", "d", "--hf-baseline", "--gguf", str(tmp_path / "missing.gguf")])
    assert rc == 2 and "needs the model's GGUF file" in capsys.readouterr().err


def test_eval_shipped_head_small_run(tmp_path):
    """`specjax eval` with the shipped EAGLE-3 head on the real default model, CPU, f32, a few
    prompts: the τ table, JSON and PNG are written, outputs equal plain decoding and drafts are
    accepted (τ > 1)."""
    from specjax.default_model import DEFAULT_HEAD_DIR, ensure_default
    ensure_default()
    out = tmp_path / "eval.json"
    rc = cli.main(["eval", "--draft", str(DEFAULT_HEAD_DIR), "--prompts", str(spec_eval.PROMPTS_DIR / "gsm8k.jsonl"),
                   "--limit", "2", "--max-tokens", "24", "--dtype", "float32", "--max-seq-len", "512",
                   "--num-steps", "4", "--topk", "1", "--warmup-tokens", "2", "--json", str(out),
                   "--markdown", str(tmp_path / "eval.md"), "--png", str(tmp_path / "eval.png")])
    assert rc == 0
    s = json.loads(out.read_text())
    g = s["categories"]["gsm8k"]
    assert g["identical"] == 2 and g["tau"] > 1.0
    assert "| gsm8k |" in (tmp_path / "eval.md").read_text() and (tmp_path / "eval.png").stat().st_size > 1000
