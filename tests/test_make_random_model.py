"""scripts/make_random_model.py: a named shape with a real model's tokenizer, loadable by LLM."""
import json
import sys
from pathlib import Path

import pytest
from tiny_dir import make_tiny_model_dir

from specjax import LLM, SamplingParams
from specjax.checkpoint import load_config
from specjax.shapes import SHAPES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import make_random_model as mrm  # noqa: E402


def test_random_model_takes_the_shape_and_the_tokenizer(tmp_path):
    src = make_tiny_model_dir(tmp_path / "src", num_layers=1)
    out = mrm.make_random_model("tiny", src, tmp_path / "rand", dtype="float32", seed=3)
    cfg = load_config(out)
    shape = SHAPES["tiny"]
    assert (cfg.hidden_size, cfg.num_layers, cfg.intermediate_size) == (
        shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"])
    src_hf = json.loads((src / "config.json").read_text())
    assert cfg.vocab_size == src_hf["vocab_size"] != shape["vocab_size"]  # the tokenizer's vocabulary
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    llm = LLM(str(out), max_batch=2, max_seq_len=128, dtype="float32")
    o = llm.generate(["w5 w6 w7"], SamplingParams(max_tokens=5, temperature=0))[0]
    assert len(o.token_ids) == 5 and all(0 <= t < cfg.vocab_size for t in o.token_ids)


def test_unknown_shape_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown shape 'nope'"):
        mrm.random_hf_config("nope", {})
