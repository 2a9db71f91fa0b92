"""The user-facing API (specjax.LLM) and the CLI on the real default model (SmolLM2-135M-Instruct),
float32. One LLM serves the module; the CLI is run in-process once for real (it builds its own LLM)
and twice on inputs it must refuse before loading anything."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import one_torch_thread
from specjax import LLM, SamplingParams
from specjax.cli import main
from specjax.default_model import ensure_default
from specjax.llm import PromptError

MAX_SEQ = 256
GREEDY8 = SamplingParams(max_tokens=8, temperature=0.0)
TEXTS = ["The capital of France is", "Write a haiku about rain.", "1, 2, 3, 4,"]
QUESTION = "What is the tallest mountain on Earth?"


@pytest.fixture(scope="module")
def model_dir():
    return ensure_default()


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(dtype="float32", max_batch=4, max_seq_len=MAX_SEQ)


def chat_ids(tokenizer, messages):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return list(ids)


def check_output(llm, o, max_tokens=8):
    assert o.finish_reason in ("stop", "length")
    assert 1 <= len(o.token_ids) <= max_tokens
    if o.finish_reason == "length":
        assert len(o.token_ids) == max_tokens
    else:
        assert o.token_ids[-1] in llm.eos_ids
    assert all(0 <= t < llm.cfg.vocab_size for t in o.token_ids)
    assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)


def hf_greedy(model_dir, prompt_ids: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations from transformers' LlamaForCausalLM built from the same weights."""
    import transformers as tf

    from specjax.checkpoint import load_flat

    cfg, flat = load_flat(model_dir, "float32")
    hf_cfg = json.loads((model_dir / "config.json").read_text())
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**{k: v for k, v in hf_cfg.items() if k != "architectures"}))
    E, L = cfg.hidden_size, cfg.num_layers
    sd = {"model.embed_tokens.weight": flat["embed"], "model.norm.weight": flat["norm.scale"]}
    for i in range(L):
        h, p = f"model.layers.{i}.", f"layers.{i}."
        sd[h + "input_layernorm.weight"] = flat[p + "attn_norm.scale"]
        sd[h + "post_attention_layernorm.weight"] = flat[p + "mlp_norm.scale"]
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj")):
            sd[h + f"self_attn.{theirs}.weight"] = flat[p + "attn." + ours].reshape(E, -1).T
        sd[h + "self_attn.o_proj.weight"] = flat[p + "attn.wo"].reshape(-1, E).T
        sd[h + "mlp.gate_proj.weight"] = flat[p + "mlp.w_gate"].T
        sd[h + "mlp.up_proj.weight"] = flat[p + "mlp.w_up"].T
        sd[h + "mlp.down_proj.weight"] = flat[p + "mlp.w_down"].T
    sd = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.eval()
    outs = []
    with torch.no_grad(), one_torch_thread():
        for ids in prompt_ids:
            seq = list(ids)
            for _ in range(n):  # explicit greedy loop (full recompute)
                nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
                seq.append(nxt)
                if nxt in cfg.eos_token_ids:
                    break
            outs.append(seq[len(ids):])
    return outs


# ----------------------------------------------------------------- LLM

def test_generate_strings_and_token_ids(llm, model_dir):
    outs = llm.generate(TEXTS, GREEDY8)
    assert len(outs) == len(TEXTS)
    for text, o in zip(TEXTS, outs):
        assert o.prompt == text
        assert o.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
        check_output(llm, o)
    assert any(o.finish_reason == "length" for o in outs)
    # the same prompts as token ids give the same tokens
    by_ids = llm.generate([o.prompt_token_ids for o in outs], GREEDY8)
    assert [o.token_ids for o in by_ids] == [o.token_ids for o in outs]
    assert all(o.prompt is None for o in by_ids)
    # a single string / a single token list are one prompt
    (one,) = llm.generate(TEXTS[0], GREEDY8)
    assert one.token_ids == outs[0].token_ids
    (one,) = llm.generate(outs[0].prompt_token_ids, GREEDY8)
    assert one.token_ids == outs[0].token_ids
    # the real model's greedy tokens equal transformers' on the same weights
    assert [o.token_ids for o in outs] == hf_greedy(model_dir, [o.prompt_token_ids for o in outs], 8)


def test_chat_applies_template(llm):
    msgs = [{"role": "user", "content": QUESTION}]
    out = llm.chat(msgs, GREEDY8)
    assert out.prompt_token_ids == chat_ids(llm.tokenizer, msgs)
    assert out.prompt_token_ids[-4:] == llm.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    check_output(llm, out)
    # several conversations at once -> a list, same tokens for the same conversation
    msgs2 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    outs = llm.chat([msgs, msgs2], GREEDY8)
    assert isinstance(outs, list) and len(outs) == 2
    assert outs[0].token_ids == out.token_ids
    assert outs[1].prompt_token_ids == chat_ids(llm.tokenizer, msgs2)


@pytest.mark.parametrize("prompts,match", [
    ("", "empty"),
    ([[]], "empty"),
    (["fine", ""], "prompt 1 is empty"),
    ([[1] * MAX_SEQ], "max_seq_len"),
    (["hello " * MAX_SEQ], "max_seq_len"),
    ([[5, 49152]], "token ids"),
    ([[-1, 5]], "token ids"),
])
def test_prompt_errors_fail_their_request(llm, prompts, match):
    """Prompts that cannot be served fail alone (finish_reason "error"); the others run."""
    outs = llm.generate(prompts, GREEDY8)
    bad = outs[-1]
    assert bad.finish_reason == "error" and match in bad.error and bad.token_ids == [] and bad.text == ""
    for o in outs[:-1]:
        check_output(llm, o)
    assert all(s is None for s in llm.engine.slots)


@pytest.mark.parametrize("prompts", [[[5, 1.0]], [[5, True]], [3.5]])
def test_prompt_type_errors_raise(llm, prompts):
    with pytest.raises(PromptError, match="token ids|string or a list"):
        llm.generate(prompts, GREEDY8)


def test_longest_allowed_prompt_is_accepted(llm):
    req = llm._request([1] * (MAX_SEQ - 1), GREEDY8, 0)
    assert req.max_len == 1


# ----------------------------------------------------------------- CLI

def test_cli_generate_jsonl(llm, tmp_path, caplog):
    import logging
    rows = [{"prompt": TEXTS[0]},
            {"turns": [QUESTION, "and the second?"], "question_id": 7, "category": "x"},
            {"prompt_ids": llm.tokenizer.encode(TEXTS[2], add_special_tokens=False), "extra": [1, {"a": 2}]}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with caplog.at_level(logging.INFO, logger="specjax"):
        rc = main(["generate", "--prompts", str(src), "--output", str(out), "--max-tokens", "8", "--dtype",
                   "float32", "--temperature", "0", "--max-batch", "4", "--max-seq-len", str(MAX_SEQ)])
    assert rc == 0
    assert "; 3 slots of " in caplog.text  # no more slots than prompts (--max-batch 4)
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(got) == 3
    # reference: the same prompts through the library (text prompts with the chat template)
    chat = lambda t: llm.apply_chat_template([{"role": "user", "content": t}])  # noqa: E731
    want = llm.generate([chat(TEXTS[0]), chat(QUESTION), rows[2]["prompt_ids"]], GREEDY8)
    assert [g["prompt"] for g in got] == [TEXTS[0], QUESTION, llm.tokenizer.decode(rows[2]["prompt_ids"])]
    for g, w in zip(got, want):
        assert {"prompt", "text", "token_ids", "finish_reason"} <= set(g)
        assert "turns" not in g and "prompt_ids" not in g
        assert (g["text"], g["token_ids"], g["finish_reason"]) == (w.text, w.token_ids, w.finish_reason)
    assert got[1]["question_id"] == 7 and got[1]["category"] == "x"
    assert got[2]["extra"] == [1, {"a": 2}]
    assert set(got[0]) == {"prompt", "text", "token_ids", "finish_reason"}


def test_cli_refuses_bad_input(tmp_path, capsys):
    """Argument errors exit 2, argparse-style, naming the flag (more cases: tests/test_cli_errors.py)."""
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"prompt": "ok"}) + "\n\n{\"prompt\": oops}\n")
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompts", str(src), "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--prompts {src}:3:" in err and "JSON" in err
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "hi", "--top-p", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--top-p must be in (0, 1]" in err and "SamplingParams" not in err


@pytest.mark.parametrize("topk", [1])
def test_cli_generate_draft_self_equals_plain(llm, tmp_path, topk):
    """`specjax generate --draft self --temperature 0 --dtype float32`: the same text as plain
    decoding, and (chain) every draft accepted: accept_len_mean == num_steps + 1."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps({"prompt": t}) for t in TEXTS[:2]) + "\n")
    rc = main(["generate", "--prompts", str(src), "--output", str(out), "--max-tokens", "8", "--dtype", "float32",
               "--temperature", "0", "--max-batch", "2", "--max-seq-len", str(MAX_SEQ), "--draft", "self",
               "--num-steps", "3", "--topk", str(topk), "--num-draft-tokens", "3" if topk == 1 else "6"])
    assert rc == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    chat = lambda t: llm.apply_chat_template([{"role": "user", "content": t}])  # noqa: E731
    want = llm.generate([chat(t) for t in TEXTS[:2]], GREEDY8)
    assert [(g["text"], g["token_ids"]) for g in got] == [(w.text, w.token_ids) for w in want]
    assert all("accept_len_mean" in g for g in got)
    if topk == 1:
        assert all(g["accept_len_mean"] == 4.0 for g in got)
    from specjax import LLM
    from specjax.tree import SpecConfig
    with pytest.raises(ValueError, match="is a 'draft' draft"):  # a method the draft cannot serve
        LLM(llm.model_dir, dtype="float32", max_batch=2, max_seq_len=128, draft="self",
            spec=SpecConfig(method="eagle", num_steps=3))


def test_cli_speculate_uses_the_shipped_head(llm, tmp_path, monkeypatch, caplog):
    """`specjax generate --speculate`: the shipped EAGLE-3 head, same greedy text as plain (f32). The
    head's weights in a copy whose specjax.json carries measured tree shapes (spec_defaults): with no
    tree flags the one for --max-batch is used."""
    import logging

    import specjax.assets
    from specjax.assets import DEFAULT_HEAD_DIR
    head = tmp_path / "head"
    head.mkdir()
    for name in ("config.json", "params"):
        (head / name).symlink_to(DEFAULT_HEAD_DIR / name)
    meta = json.loads((DEFAULT_HEAD_DIR / "specjax.json").read_text())
    meta["spec_defaults"] = {"1": {"num_steps": 3, "topk": 2, "num_draft_tokens": 5},
                             "8": {"num_steps": 2, "topk": 1, "num_draft_tokens": 2}, "16": "plain", "32": "plain"}
    (head / "specjax.json").write_text(json.dumps(meta))
    monkeypatch.setattr(specjax.assets, "DEFAULT_HEAD_DIR", head)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": TEXTS[0]}) + "\n")
    with caplog.at_level(logging.INFO, logger="specjax"):
        rc = main(["generate", "--prompts", str(src), "--output", str(out), "--max-tokens", "8", "--dtype",
                   "float32", "--temperature", "0", "--max-batch", "1", "--max-seq-len", str(MAX_SEQ), "--speculate"])
    assert rc == 0
    got = json.loads(out.read_text())
    want = llm.generate([llm.apply_chat_template([{"role": "user", "content": TEXTS[0]}])], GREEDY8)[0]
    assert (got["text"], got["token_ids"]) == (want.text, want.token_ids)
    assert got["accept_len_mean"] >= 1.0
    assert "num_steps=3 topk=2 num_draft_tokens=5 (the draft's spec_defaults for batch 1)" in caplog.text
    assert "speculative (eagle3: num_steps=3 topk=2 num_draft_tokens=5" in caplog.text  # the engine runs it
    assert "lazy steps (plain decoding's program, the draft caught up when read again) for batches of >= 16 rows" \
        in caplog.text  # "plain" from 16; an EAGLE head's plain steps leave its draft behind


def test_head_spec_defaults(tmp_path):
    """The entry of the largest batch <= the asked one (else the smallest), "plain" entries skipped;
    the threshold of lite steps: the smallest batch from which every entry is "plain"; malformed
    tables are named errors; no table: None."""
    from specjax.checkpoint import CheckpointError, head_spec_defaults, head_speculate_below
    (tmp_path / "specjax.json").write_text(json.dumps({"kind": "eagle3"}))
    assert head_spec_defaults(tmp_path, 4) is None and head_speculate_below(tmp_path) is None
    table = {"1": {"num_steps": 5, "topk": 1, "num_draft_tokens": 5}, "16": {"num_steps": 3, "topk": 2},
             "64": {"num_steps": 2}}
    (tmp_path / "specjax.json").write_text(json.dumps({"spec_defaults": table}))
    assert head_spec_defaults(tmp_path, 1) == (table["1"], 1)
    assert head_spec_defaults(tmp_path, 15) == (table["1"], 1)
    assert head_spec_defaults(tmp_path, 32) == (table["16"], 16)
    assert head_spec_defaults(tmp_path, 512) == (table["64"], 64)
    (tmp_path / "specjax.json").write_text(json.dumps({"spec_defaults": {"4": {"num_steps": 5}}}))
    assert head_spec_defaults(tmp_path, 1) == ({"num_steps": 5}, 4)  # smaller than every entry
    table = {"1": {"num_steps": 5}, "8": "plain", "16": {"num_steps": 3}, "32": "plain", "64": "plain"}
    (tmp_path / "specjax.json").write_text(json.dumps({"spec_defaults": table}))
    assert head_spec_defaults(tmp_path, 8) == ({"num_steps": 5}, 1)  # "plain" entries give no tree shape
    assert head_spec_defaults(tmp_path, 64) == ({"num_steps": 3}, 16)
    assert head_speculate_below(tmp_path) == 32  # every entry from 32 on is "plain" (8 alone is not enough)
    table["64"] = {"num_steps": 2}
    (tmp_path / "specjax.json").write_text(json.dumps({"spec_defaults": table}))
    assert head_speculate_below(tmp_path) is None  # speculation pays at the largest batch measured
    (tmp_path / "specjax.json").write_text(json.dumps({"spec_defaults": {"1": "plain"}}))
    assert head_spec_defaults(tmp_path, 4) is None and head_speculate_below(tmp_path) == 1
    entry = {"num_steps": 5, "topk": 4, "num_draft_tokens": 20, "ngram_branch": 4}  # an n-gram branch is kept
    (tmp_path / "specjax.json").write_text(json.dumps({"spec_defaults": {"1": {**entry, "note": "x"}}}))
    assert head_spec_defaults(tmp_path, 1) == (entry, 1)
    for bad in ({"one": {"num_steps": 2}}, {"1": {"topk": 2}}, {"1": 3}, {"1": "plainly"}):
        (tmp_path / "specjax.json").write_text(json.dumps({"spec_defaults": bad}))
        with pytest.raises(CheckpointError, match="spec_defaults"):
            head_spec_defaults(tmp_path, 1)


def test_measurement_note(tmp_path):
    """spec_defaults measured with another attention implementation than the engine's are named
    (LLM logs it as a warning); the same implementation, or no record, says nothing."""
    from specjax.checkpoint import measurement_note
    (tmp_path / "specjax.json").write_text(json.dumps({"spec_defaults": {"1": {"num_steps": 5}, "32": "plain"}}))
    assert measurement_note(tmp_path, "reference") is None
    (tmp_path / "specjax.json").write_text(json.dumps({"spec_defaults": {"32": "plain"}, "spec_defaults_measured": {
        "attention": "mosaic_gpu", "device": "NVIDIA H100 80GB HBM3"}}))
    assert measurement_note(tmp_path, "mosaic_gpu") is None
    note = measurement_note(tmp_path, "cudnn")
    assert "measured with attention mosaic_gpu on NVIDIA H100 80GB HBM3" in note and "runs cudnn" in note


def test_shipped_head_records_its_measurement():
    from specjax.assets import DEFAULT_HEAD_DIR
    from specjax.checkpoint import head_spec_defaults, head_speculate_below, measurement_note, read_meta
    assert read_meta(DEFAULT_HEAD_DIR)["spec_defaults_measured"]["attention"] == "mosaic_gpu"
    assert head_speculate_below(DEFAULT_HEAD_DIR) is None  # measured to pay up to batch 64 (session 29)
    assert head_spec_defaults(DEFAULT_HEAD_DIR, 64) == ({"num_steps": 4, "topk": 2, "num_draft_tokens": 8}, 32)
    assert "runs reference" in measurement_note(DEFAULT_HEAD_DIR, "reference")


@pytest.mark.parametrize("min_rows", [None, 2])
def test_llm_fused_min_rows(llm, min_rows):
    """LLM(fused_min_rows=...): by default (1) a lone request's fused steps run one row, with 2 two rows
    (a padding row); the same greedy text as plain either way (f32)."""
    from specjax import LLM
    from specjax.tree import SpecConfig
    kw = {} if min_rows is None else {"fused_min_rows": min_rows}
    spec = LLM(llm.model_dir, dtype="float32", max_batch=1, max_seq_len=MAX_SEQ, draft="self",
               spec=SpecConfig(method="draft", num_steps=2, topk=2, num_draft_tokens=3), **kw)
    assert spec.engine.batch_opts.fused_min_rows == (min_rows or 1)
    got = spec.generate(TEXTS[:1], GREEDY8)
    assert [g.token_ids for g in got] == [w.token_ids for w in llm.generate(TEXTS[:1], GREEDY8)]
    assert {d for k, ds in spec.engine.shapes.used.items() if k[:2] == ("decode", "spec") for d in ds} == \
        {(min_rows or 1,)}
