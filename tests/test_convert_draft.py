"""`specjax convert --draft`: EAGLE-1 / EAGLE-3 head folders (pytorch_model.bin or model.safetensors)
-> specjax draft directories -> checkpoint.load_draft, checked against the torch reference of
test_eagle; every conversion and load error names its problem."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import tiny_config
from safetensors.torch import save_file
from test_eagle import AUX, VD, E, V, check_against_reference, head_config, head_state_dict
from test_eagle import target  # noqa: F401 - the session fixture (tiny target + its outputs)

from specjax import cli
from specjax.checkpoint import CheckpointError, load_draft, read_meta
from specjax.convert import ConvertError, convert_draft
from specjax.models import eagle


def write_head(d, method, fmt="bin", sd=None, hc=None, embed=True):
    """A head folder as the public repos ship it; returns (hc, sd)."""
    hc = head_config(method) if hc is None else hc
    sd = head_state_dict(method, hc) if sd is None else sd
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(hc))
    full = dict(sd)
    if embed:  # shipped by some heads; the target's embedding is used instead
        full["embed_tokens.weight"] = torch.randn(V, E)
    if fmt == "bin":
        torch.save(full, d / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in full.items()}, str(d / "model.safetensors"))
    return hc, sd


@pytest.mark.parametrize("method,fmt", [("eagle", "bin"), ("eagle", "safetensors"), ("eagle3", "bin"),
                                        ("eagle3", "safetensors")])
def test_convert_load_matches_reference(tmp_path, method, fmt, target):
    hc, sd = write_head(tmp_path / "src", method, fmt)
    out = convert_draft(tmp_path / "src", tmp_path / "out", dtype="float32", progress=False)
    assert read_meta(out)["kind"] == method
    saved = json.loads((out / "config.json").read_text())
    assert saved["specjax_draft"]["method"] == method
    assert saved["specjax_draft"]["aux_layers"] == (list(AUX) if method == "eagle3" else None)
    head, cfg = load_draft(out, target[0], "float32")
    assert isinstance(head, eagle.EagleHead) and cfg.method == method
    check_against_reference(method, hc, sd, cfg, head, target)


def test_bfloat16_and_default_aux_layers(tmp_path, target):
    hc = head_config("eagle3")
    del hc["eagle_config"]  # aux layers decided at load time from the target's depth
    write_head(tmp_path / "src", "eagle3", "safetensors", hc=hc)
    out = convert_draft(tmp_path / "src", tmp_path / "out", progress=False)
    assert json.loads((out / "config.json").read_text())["specjax_draft"]["aux_layers"] is None
    tcfg8 = tiny_config(num_hidden_layers=8)
    head, cfg = load_draft(out, tcfg8)
    assert cfg.aux_layers == (2, 4, 5)
    dtypes = {k: str(v.dtype) for k, v in eagle.flat_state(head).items()}
    assert dtypes.pop("d2t") == "int32" and set(dtypes.values()) == {"bfloat16"}
    head32, _ = load_draft(out, tcfg8, "float32")
    assert head32.lm_head[...].dtype == jnp.float32
    with pytest.raises(CheckpointError, match="out of range"):  # default (2, 1, -1) on a 2-layer target
        load_draft(out, tiny_config(num_hidden_layers=2))


def test_cli_convert_draft(tmp_path, capsys):
    write_head(tmp_path / "src", "eagle")
    rc = cli.main(["convert", "--draft", str(tmp_path / "src"), str(tmp_path / "out"), "--dtype", "float32"])
    assert rc == 0, capsys.readouterr().err
    assert read_meta(tmp_path / "out")["kind"] == "eagle"
    rc = cli.main(["convert", "--draft", str(tmp_path / "missing"), str(tmp_path / "out2")])
    assert rc == 2 and "not a folder" in capsys.readouterr().err


def _sd_with(method, change):
    sd = head_state_dict(method, head_config(method))
    change(sd)
    return sd


@pytest.mark.parametrize("case,method,change,match", [
    ("missing", "eagle", lambda sd: sd.pop("layers.0.mlp.up_proj.weight"),
     r"1 tensor\(s\) missing for an EAGLE-1 head: layers.0.mlp.up_proj.weight"),
    ("unexpected", "eagle", lambda sd: sd.__setitem__("layers.1.mlp.up_proj.weight", torch.zeros(3)),
     r"unexpected tensor\(s\) for an EAGLE-1 head .*layers.1.mlp.up_proj.weight"),
    ("shape", "eagle3", lambda sd: sd.__setitem__("midlayer.self_attn.q_proj.weight", torch.zeros(32, 32)),
     r"midlayer.self_attn.q_proj.weight has shape \(32, 32\), expected \(32, 64\)"),
    ("d2t", "eagle3", lambda sd: sd.__setitem__("d2t", torch.zeros(VD + 1, dtype=torch.int64)),
     rf"d2t has shape \({VD + 1},\), expected \({VD},\)"),
    ("t2d", "eagle3", lambda sd: sd.__setitem__("t2d", torch.ones(V - 1, dtype=torch.bool)),
     rf"t2d has shape \({V - 1},\), expected \({V},\)"),
    ("t2d_count", "eagle3", lambda sd: sd.__setitem__("t2d", torch.ones(V, dtype=torch.bool)),
     rf"t2d marks {V} target ids, expected draft_vocab_size={VD}"),
    ("d2t_range", "eagle3", lambda sd: sd.__setitem__("d2t", torch.full((VD,), V, dtype=torch.int64)),
     "d2t maps draft ids outside the target vocab"),
    ("layout", "eagle", lambda sd: [sd.pop(k) for k in list(sd) if k.startswith("layers.0.")],
     "not an EAGLE-1 or EAGLE-3 head"),
])
def test_conversion_errors(tmp_path, case, method, change, match):
    write_head(tmp_path / "src", method, "safetensors" if case == "d2t_range" else "bin",
               sd=_sd_with(method, change))
    with pytest.raises(ConvertError, match=match):
        convert_draft(tmp_path / "src", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_missing_files(tmp_path):
    (tmp_path / "a").mkdir()
    with pytest.raises(ConvertError, match="has no config.json"):
        convert_draft(tmp_path / "a", tmp_path / "out", progress=False)
    (tmp_path / "a" / "config.json").write_text(json.dumps(head_config("eagle")))
    with pytest.raises(ConvertError, match="no weight file"):
        convert_draft(tmp_path / "a", tmp_path / "out", progress=False)
    (tmp_path / "a" / "config.json").write_text("{not json")
    with pytest.raises(ConvertError, match="not valid JSON"):
        convert_draft(tmp_path / "a", tmp_path / "out", progress=False)


def test_load_errors(tmp_path):
    write_head(tmp_path / "src", "eagle3", "safetensors")
    out = convert_draft(tmp_path / "src", tmp_path / "out", dtype="float32", progress=False)
    tcfg = tiny_config(num_hidden_layers=4)
    with pytest.raises(CheckpointError, match="config.json: draft head hidden_size=32 != target hidden_size=64"):
        load_draft(out, tiny_config(num_hidden_layers=4, hidden_size=64, head_dim=16))
    with pytest.raises(CheckpointError, match="vocab_size=97 != target vocab_size=100"):
        load_draft(out, tiny_config(num_hidden_layers=4, vocab_size=100))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_draft(tmp_path / "nope", tcfg)
    # a target model directory (marker without a draft kind) is not a draft
    tgt = tmp_path / "tgt"
    tgt.mkdir()
    (tgt / "specjax.json").write_text(json.dumps({"format_version": 1, "dtype": "float32"}))
    (tgt / "config.json").write_text(json.dumps(head_config("eagle")))
    with pytest.raises(CheckpointError, match="not a converted draft head"):
        load_draft(tgt, tcfg)
    # params that do not match the config
    cfg_path = out / "config.json"
    d = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**d, "intermediate_size": 40}))
    with pytest.raises(CheckpointError, match=r"shape mismatch: mlp.w_down"):
        load_draft(out, tcfg)


def test_load_draft_under_jit_and_to_target_ids(tmp_path, target):
    _, sd = write_head(tmp_path / "src", "eagle3", "safetensors")
    out = convert_draft(tmp_path / "src", tmp_path / "out", dtype="float32", progress=False)
    head, _ = load_draft(out, target[0], "float32")
    ids = jnp.arange(VD, dtype=jnp.int32)
    got = nnx.jit(lambda h, i: h.to_target_ids(i))(head, ids)
    want = np.arange(VD) + sd["d2t"].numpy()
    np.testing.assert_array_equal(np.asarray(got), want)
    assert sd["t2d"].numpy()[want].all()
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(nnx.state(head)))
