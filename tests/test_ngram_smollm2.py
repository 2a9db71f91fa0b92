"""The n-gram drafter on the real default model (SmolLM2-135M-Instruct, float32): greedy output
equals plain greedy output token for token, from the API (a trie, page size 1, batch 2) and from
`specjax generate --speculate ngram` (a chain, page size 16); on prompts whose answers copy the
prompt the drafts are accepted (tau > 1)."""
from __future__ import annotations

import json

import pytest

from specjax import LLM, SamplingParams
from specjax.cli import main
from specjax.default_model import ensure_default
from specjax.tree import SpecConfig

MAX_SEQ = 256
TOKENS = 24
PROMPTS = ["Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog.",
           "Rewrite this sentence in the past tense: The children walk to school and play in the park."]
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain():
    ensure_default()
    llm = LLM(dtype="float32", max_batch=2, max_seq_len=MAX_SEQ)
    chats = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    return chats, [o.token_ids for o in llm.generate(chats, GREEDY)]


def test_api_ngram_tree_equals_plain(plain):
    chats, want = plain
    llm = LLM(dtype="float32", max_batch=2, max_seq_len=MAX_SEQ, page_size=1,
              spec=SpecConfig(method="ngram", num_steps=4, topk=2, num_draft_tokens=6, ngram_max=3))
    assert llm.spec.method == "ngram" and llm.engine.draft.model is None
    outs = llm.generate(chats, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert all(o.accept_len_mean > 1.2 for o in outs), [o.accept_len_mean for o in outs]


def test_cli_speculate_ngram_equals_plain(plain, tmp_path):
    chats, want = plain
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    rc = main(["generate", "--prompts", str(src), "--output", str(out), "--max-tokens", str(TOKENS),
               "--dtype", "float32", "--temperature", "0", "--max-batch", "2", "--max-seq-len", str(MAX_SEQ),
               "--speculate", "ngram", "--num-steps", "5"])
    assert rc == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    # the CLI stops at EOS: its tokens are plain's up to the first EOS
    for g, w in zip(got, want):
        assert g["token_ids"] == w[: len(g["token_ids"])] and len(g["token_ids"]) >= 8
    assert all(g["accept_len_mean"] > 1.2 for g in got), [g["accept_len_mean"] for g in got]


def test_ngram_api_and_cli_refusals(capsys):
    with pytest.raises(ValueError, match="needs a draft"):
        LLM(dtype="float32", max_seq_len=64, spec=SpecConfig(method="eagle3"))
    for argv, msg in ((["--draft", "self"], "--speculate ngram drafts from the text itself: drop --draft"),
                      (["--ngram-min", "5"], "--ngram-min=5 exceeds --ngram-max=4")):
        with pytest.raises(SystemExit) as e:
            main(["generate", "--prompt", "hi", "--speculate", "ngram", *argv])
        assert e.value.code == 2 and msg in capsys.readouterr().err
