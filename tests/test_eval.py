"""specjax.eval: the shipped prompt sets load, the summary renders as a markdown table and a PNG,
the CLI parses `specjax eval` (default drafter, --speculate ngram, --quick, defaults in --help, the
CPU size warning) and refuses bad combinations before loading anything; acceptance statistics and
the HF transformers peer (plain and prompt lookup, on a tiny random HF model); two small real runs
on the default model: the shipped head (the default) and the n-gram drafter. (A `specjax eval` run
with a freshly trained head: tests/test_train.py.)"""
from __future__ import annotations

import json
import logging

import pytest

from specjax import cli
from specjax import eval as spec_eval, eval_hf, eval_report
from specjax.engine_options import BatchOptions


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


def _summary(hf=False, lookup=False):
    def cat(tau, sp):
        return {"prompts": 2, "tokens_plain": 100, "tokens_spec": 100, "seconds_plain": 1.0, "seconds_spec": 1.0 / sp,
                "tok_s_plain": 100.0, "tok_s_spec": 100.0 * sp, "tau": tau, "spec_steps": 40,
                "tau_to_eos": tau - 0.5, "steps_to_eos": 30, "acc": [0.75, 0.5, 0.25, 0.125],
                "tau_per_prompt": [tau - 0.1, tau + 0.1], "identical": 2, "speedup": sp}
    s = {"settings": {"model": "m", "draft": "checkpoints/head", "method": "eagle3", "num_steps": 4, "topk": 1,
                      "num_draft_tokens": 4, "max_batch": 1, "max_tokens": 64, "dtype": "bfloat16",
                      "chat": True, "device": "cpu", "backend": "cpu"},
         "categories": {"mt_bench": cat(2.5, 1.8), "gsm8k": cat(3.0, 2.1)}, "overall": cat(2.75, 1.95)}
    s["overall"]["prompts"] = 4
    if hf:
        s["hf"] = {"categories": {"mt_bench": {"tok_s": 40.0}, "gsm8k": {"tok_s": 50.0}}, "overall": {"tok_s": 45.0}}
        if lookup:
            for v, t in zip(list(s["hf"]["categories"].values()) + [s["hf"]["overall"]], (80.0, 75.0, 77.5)):
                v["tok_s_lookup"] = t
    return s


def test_markdown_and_plot(tmp_path):
    md = eval_report.markdown(_summary())
    assert "| mt_bench | 2 | 2.50 | 2.00 | 0.75/0.50/0.25/0.12 | 100.0 | 180.0 | 1.80x | 2/2 |" in md
    assert "| **overall** | 4 | 2.75 |" in md and "HF" not in md and "EOS ignored: equal work" in md
    md = eval_report.markdown(_summary(hf=True))
    assert "| gsm8k | 2 | 3.00 | 2.50 | 0.75/0.50/0.25/0.12 | 100.0 | 210.0 | 2.10x | 2/2 | 50.0 | 2.00x | 4.20x |" in md
    md = eval_report.markdown(_summary(hf=True, lookup=True))
    assert "HF lookup speed-up" in md and "spec / HF lookup" in md
    assert "| 2/2 | 50.0 | 75.0 | 1.50x | 2.00x | 2.80x |" in md
    png = eval_report.plot(_summary(), tmp_path / "e.png")
    assert png.stat().st_size > 1000


def _args(*argv):
    a = cli.build_parser().parse_args(["eval", *argv])
    spec_eval.resolve(a)
    return a


def test_cli_eval_arguments(tmp_path, capsys):
    a = _args("--draft", "d", "--limit", "2", "--prompts", "x.jsonl", "y.jsonl", "--num-steps", "5", "--topk", "2",
              "--max-batch", "4", "--json", "o.json")
    assert (a.draft, a.limit, a.prompts, a.num_steps, a.topk, a.max_batch, a.max_tokens, a.fn) == (
        "d", 2, ["x.jsonl", "y.jsonl"], 5, 2, 4, 256, spec_eval.cmd_eval)
    from specjax.assets import DEFAULT_HEAD_DIR
    assert _args().draft == str(DEFAULT_HEAD_DIR)  # the shipped head by default, like generate --speculate
    assert _args("--speculate", "head").draft == str(DEFAULT_HEAD_DIR)
    a = _args("--speculate", "ngram", "--ngram-max", "3", "--model", "m")  # n-gram serves any model
    assert (a.draft, a.ngram_max, a.ngram_min) == ("ngram", 3, 1)
    a = _args("--quick")
    assert (a.limit, a.max_tokens) == (spec_eval.QUICK_LIMIT, spec_eval.QUICK_TOKENS)
    assert (a.attention, _args("--attention", "cudnn").attention) == ("auto", "cudnn")
    from specjax import attention as attn_lib  # every name the flag takes is an implementation
    from specjax.machine import ATTENTION_CHOICES
    assert set(ATTENTION_CHOICES) - {"auto"} <= set(attn_lib._FACTORIES)
    with pytest.raises(SystemExit):
        _args("--attention", "flash")
    assert (_args("--quick", "--limit", "5").limit, _args("--quick", "--max-tokens", "9").max_tokens) == (5, 9)
    for argv, msg in ((["--model", "m"], "with --model give --draft DIR or --speculate ngram"),
                      (["--speculate", "ngram", "--draft", "d"], "not both"),
                      (["--draft", "d", "--repeats", "0"], "--repeats must be >= 1, got 0"),
                      (["--draft", "d", "--hf-baseline", "--gguf", str(tmp_path / "missing.gguf")],
                       "needs the model's GGUF file")):
        assert cli.main(["eval", *argv]) == 2 and msg in capsys.readouterr().err


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["eval", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in ("(default: 256; 32 with --quick)", "(tree depth; default: the draft's spec_defaults, else 4)", "(default: auto)",
                 "(default: head, unless --draft)", "longest suffix matched (default: 4)", "(default: 10)"):
        assert text in out, text
    assert "(default: None)" not in out


def test_size_warning():
    sets = spec_eval.load_sets()
    w = spec_eval.size_warning(sets, 256, "cpu")
    n = sum(map(len, sets.values()))
    assert w and f"{n} prompts x 256 tokens" in w and "--quick" in w
    assert spec_eval.size_warning(sets, 256, "gpu") is None
    quick = spec_eval.load_sets(limit=spec_eval.QUICK_LIMIT)
    assert spec_eval.size_warning(quick, spec_eval.QUICK_TOKENS, "cpu") is None
    assert "and HF" in spec_eval.size_warning(sets, 256, "cpu", hf=True)


def test_acceptance_statistics():
    # prefill emits 1 token; steps emit 3, 1, 4, ...: the EOS at index 4 (5 tokens) is reached by step 2
    assert spec_eval.response_steps([3, 1, 4, 2], [7, 7, 7, 7, 0, 7, 7], eos=(0,)) == 2
    assert spec_eval.response_steps([3, 1, 4, 2], [0, 7], eos=(0,)) == 0
    assert spec_eval.response_steps([3, 1], [7, 7, 7, 7, 7, 7], eos=(0,)) == 2  # no EOS: every step
    st = spec_eval.acceptance([[1, 3, 5], [2]], num_steps=4)
    assert st["tau"] == 11 / 4 and st["spec_steps"] == 4
    assert st["acc"] == [3 / 4, 2 / 4, 1 / 4, 1 / 4]


def test_hf_peer_plain_and_prompt_lookup():
    """hf_timings on a tiny random HF Llama: both modes generate exactly max_tokens per prompt (EOS
    ignored: the EOS id is made the most likely token) and greedy prompt lookup gives the same tokens."""
    import torch
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=5, bos_token_id=1)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.bias = None
        model.lm_head.weight[5] += 0.5 * model.lm_head.weight.norm(dim=1).max()  # EOS favoured
    ids = {"a": [[3, 4, 6, 3, 4, 6, 3, 4], [9, 10, 11]], "b": [[12, 13, 12, 13, 12]]}
    res = eval_hf.hf_timings(model, ids, max_tokens=12, lookup_tokens=4, lookup_ngram=2, log=lambda m: None)
    assert res["categories"]["a"]["tokens"] == res["categories"]["a"]["tokens_lookup"] == 24
    assert res["overall"]["tokens"] == 36 and res["overall"]["identical_lookup"] == 3
    assert res["overall"]["tok_s"] > 0 and res["overall"]["speedup_lookup"] > 0
    only = eval_hf.hf_timings(model, {"b": ids["b"]}, max_tokens=4, lookup_tokens=0, log=lambda m: None)
    assert "tok_s_lookup" not in only["overall"] and only["overall"]["tokens"] == 4


def test_eval_shipped_head_small_run(tmp_path, monkeypatch, caplog):
    """`specjax eval` (no drafter given: the shipped EAGLE-3 head) on the real default model, CPU,
    f32, a few prompts: equal work (the same tokens per prompt, EOS ignored), the τ table, JSON and
    PNG are written, outputs equal plain decoding and drafts are accepted (τ > 1).
    The attention split caps are made to apply here as on a GPU (specjax.attention.split_cap), with a
    short first prompt and a long second one: fused programs with and without the cap both run (the
    long rows pass half of SHORT_CONTEXT, where the engine compiles the uncapped sibling on its worker
    thread), and the warm-up compiles every program the timed runs use, the worker's included (the
    eval waits for the worker before counting)."""
    from specjax import attention as attn_lib
    from specjax.assets import DEFAULT_HEAD_DIR
    from specjax.default_model import ensure_default
    ensure_default()
    monkeypatch.setattr(attn_lib, "SPLIT_KERNELS", attn_lib.SPLIT_KERNELS + ("reference",))
    monkeypatch.setattr(attn_lib, "SHORT_CONTEXT", 400)  # the short prompt's rows stay under 200 keys
    q = [json.loads(line)["turns"][0] for line in (spec_eval.PROMPTS_DIR / "gsm8k.jsonl").open()][:6]
    src, out = tmp_path / "gsm8k.jsonl", tmp_path / "eval.json"
    src.write_text(json.dumps({"turns": [q[0]]}) + "\n" + json.dumps({"turns": [" ".join(q[1:])]}) + "\n")
    with caplog.at_level(logging.INFO, logger="specjax"):
        rc = cli.main(["eval", "--prompts", str(src),
                       "--limit", "2", "--max-tokens", "24", "--dtype", "float32", "--max-seq-len", "512",
                       "--num-steps", "4", "--topk", "1", "--warmup-tokens", "2", "--json", str(out),
                       "--markdown", str(tmp_path / "eval.md"), "--png", str(tmp_path / "eval.png")])
    assert rc == 0
    assert "attention split cap 8 for" in caplog.text and "attention split cap None for" in caplog.text
    s = json.loads(out.read_text())
    assert s["settings"]["draft"] == str(DEFAULT_HEAD_DIR) and s["settings"]["method"] == "eagle3"
    assert "reference" in s["settings"]["attention_plain"] and "forced" not in s["settings"]["attention_spec"]
    g = s["categories"]["gsm8k"]
    assert g["identical"] == 2 and g["tau"] > 1.0 and g["tokens_plain"] == g["tokens_spec"] == 48
    assert len(g["acc"]) == 4 and 0 <= g["acc"][3] <= g["acc"][0] <= 1
    # the warm-up compiled every program the timed runs use (a program added while timed stalls them)
    assert (g["new_programs_plain"], g["new_programs_spec"]) == (0, 0)
    assert s["overall"]["new_programs_spec"] == 0
    # the request boundaries of the speculative run are counted (one category: the overall sums equal it)
    assert 0 <= g["admit_ahead_misses"] <= g["admitted_ahead"] <= 1 and g["held_back_steps"] >= 0
    assert all(s["overall"][k] == g[k] for k in spec_eval.BOUNDARY_STATS)
    assert "| gsm8k |" in (tmp_path / "eval.md").read_text() and (tmp_path / "eval.png").stat().st_size > 1000


@pytest.mark.parametrize("handover", [False, True])
def test_eval_ngram_small_run(tmp_path, capsys, handover):
    """`specjax eval --speculate ngram` on two short prompts whose answers copy them (f32, a tree,
    two timed runs per engine): outputs equal plain decoding, the same work, and the drafts are
    accepted (τ > 1); by default at batch 1 with row hand-over (the second prompt prefilled while the first
    runs) and two dispatches unread, here with --spec-steps-per-call 8, the same and no slot given up ahead;
    --no-handover --unread 1 as before session 43."""
    from specjax.default_model import ensure_default
    ensure_default()
    src, out = tmp_path / "copy.jsonl", tmp_path / "eval.json"
    src.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in (
        "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog.",
        "Rewrite this sentence in the past tense: The children walk to school and play in the park.")))
    rc = cli.main(["eval", "--speculate", "ngram", "--prompts", str(src), "--max-tokens", "24", "--dtype", "float32",
                   "--max-seq-len", "128", "--num-steps", "4", "--topk", "2", "--warmup-tokens", "2",
                   "--attention", "reference", "--repeats", "2", "--json", str(out),
                   *(["--spec-steps-per-call", "8"] if handover else ["--no-handover", "--unread", "1"])])
    assert rc == 0, capsys.readouterr().err
    s = json.loads(out.read_text())
    assert s["settings"]["handover"] is handover and s["settings"]["unread"] == (2 if handover else 1)
    assert s["settings"]["spec_steps_per_call"] == (8 if handover else BatchOptions.spec_steps_per_call)
    if handover:
        assert s["overall"]["admitted_ahead"] == 0
    assert (s["settings"]["method"], s["settings"]["draft"], s["settings"]["ngram_max"]) == ("ngram", "ngram", 4)
    assert "reference (forced)" in s["settings"]["attention_plain"] == s["settings"]["attention_spec"]
    c = s["categories"]["copy"]
    assert s["settings"]["repeats"] == 2  # two timed runs of each engine: their tokens add up
    assert c["identical"] == 2 and c["tokens_plain"] == c["tokens_spec"] == 2 * 48
    for e in ("plain", "spec"):  # each repeat's timed run, summing to the set's seconds
        runs = c[f"seconds_{e}_runs"]
        assert len(runs) == 2 and min(runs) > 0 and abs(sum(runs) - c[f"seconds_{e}"]) < 1e-3, (e, runs)
    runs = c["spec_runs"]  # the speculative engine's counters per repeat: they add up to the set's
    assert len(runs) == 2 and set(runs[0]) == set(spec_eval.RUN_STATS)
    assert sum(r["spec_dispatch_steps"] for r in runs) == c["fused_steps"] > 0
    assert all(r["prefill_tokens"] + r["prefix_cache_hit_tokens"] > 0 and r["host_step_s"] > 0 for r in runs)
    assert c["tau"] > 1.2 and c["acc"][0] > 0.1
    from specjax.adaptive import NGRAM_MIN_ACCEPT  # the acceptance gate is on by default for n-gram
    assert s["settings"]["min_accept"] == NGRAM_MIN_ACCEPT and c["fused_steps"] > 0 and c["lite_steps"] >= 0
    text = capsys.readouterr().out
    assert "ngram, n-gram 4..1" in text and "lite / fused steps" in text and "lite steps below τ 1.35" in text
