"""tests/_model_cache.py: the suite's per-process memo of checkpoint.load_model / load_draft. A second
load of a checkpoint reads no file and hands out a module of its own (over the same immutable
buffers); a rewritten or touched checkpoint, or a deleted buffer, makes it read again."""
from __future__ import annotations

import os

import _model_cache
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_dir import make_tiny_model_dir

from specjax import checkpoint
from specjax.models.llama import flat_state

REAL_LOAD = getattr(checkpoint.load_model, "real", checkpoint.load_model)  # the library's own


@pytest.fixture
def memo(monkeypatch):
    """A fresh memo of the real load_model, and a count of load_flat calls (the checkpoint reads)."""
    reads = []
    real_flat = checkpoint.load_flat

    def counting_flat(*args, **kw):
        reads.append(args[0])
        return real_flat(*args, **kw)

    monkeypatch.setattr(checkpoint, "load_flat", counting_flat)  # load_model looks it up when it runs
    m = _model_cache.Memo(REAL_LOAD, _model_cache.model_key)
    return m, reads


def _values(model) -> dict:
    return {k: np.asarray(v) for k, v in flat_state(model).items()}


def test_conftest_installs_the_memo():
    if os.environ.get("SPECJAX_TEST_LOAD_CACHE") == "0":
        assert not isinstance(checkpoint.load_model, _model_cache.Memo)
    else:
        assert isinstance(checkpoint.load_model, _model_cache.Memo)
        assert isinstance(checkpoint.load_draft, _model_cache.Memo)


def test_second_load_reads_no_file_and_is_a_copy(tmp_path, memo):
    load, reads = memo
    d = make_tiny_model_dir(tmp_path / "m")
    cfg1, m1 = load(d, "float32")
    cfg2, m2 = load(str(d), dtype="float32")  # the same key however the arguments are spelled
    assert len(reads) == 1 and dict(load.stats) == {"misses": 1, "hits": 1}
    assert cfg1 == cfg2 and m1 is not m2 and m1.embed is not m2.embed
    before = _values(m1)
    assert _values(m2).keys() == before.keys() and all(np.array_equal(before[k], v) for k, v in _values(m2).items())
    # what one test does to its module reaches no other: a parameter replaced, an attention implementation set
    m2.embed[...] = jnp.zeros_like(m2.embed[...])
    m2.layers[0].attn.attn_impl = "changed"
    _, m3 = load(d, "float32")
    assert len(reads) == 1 and m3.layers[0].attn.attn_impl == m1.layers[0].attn.attn_impl != "changed"
    assert all(np.array_equal(before[k], v) for k, v in _values(m3).items())
    assert np.array_equal(_values(m1)["embed"], before["embed"])
    # the same values as an uncached load
    _, fresh = REAL_LOAD(d, "float32")
    assert all(np.array_equal(v, _values(fresh)[k]) for k, v in before.items())


def test_deleted_buffer_is_read_again(tmp_path, memo):
    """The clones share the cached (immutable) buffers; one deleted (a donation) makes the next load
    read the checkpoint again rather than hand out a dead array."""
    load, reads = memo
    d = make_tiny_model_dir(tmp_path / "m")
    _, m1 = load(d, "float32")
    want = _values(m1)["embed"]
    m1.embed[...].delete()
    _, m2 = load(d, "float32")
    assert len(reads) == 2 and dict(load.stats) == {"misses": 2}
    assert np.array_equal(_values(m2)["embed"], want)
    load(d, "float32")
    assert len(reads) == 2 and load.stats["hits"] == 1


def test_dtype_is_part_of_the_key(tmp_path, memo):
    load, reads = memo
    d = make_tiny_model_dir(tmp_path / "m")
    _, m32 = load(d)  # the checkpoint's dtype (float32)
    _, m16 = load(d, jnp.bfloat16)
    _, m16b = load(d, "bfloat16")
    assert len(reads) == 2 and load.stats["hits"] == 1
    assert m32.embed[...].dtype == jnp.float32 and m16.embed[...].dtype == m16b.embed[...].dtype == jnp.bfloat16


def test_rewritten_checkpoint_is_read_again(tmp_path, memo):
    load, reads = memo
    d = make_tiny_model_dir(tmp_path / "m", seed=0)
    _, old = load(d, "float32")
    make_tiny_model_dir(d, seed=1)  # rewritten in place: other values
    _, new = load(d, "float32")
    assert len(reads) == 2 and load.stats["misses"] == 2
    assert not np.array_equal(_values(old)["embed"], _values(new)["embed"])
    _, fresh = REAL_LOAD(d, "float32")
    assert np.array_equal(_values(new)["embed"], _values(fresh)["embed"])


def test_touched_checkpoint_is_read_again(tmp_path, memo):
    load, reads = memo
    d = make_tiny_model_dir(tmp_path / "m")
    load(d, "float32")
    files = [p for p in (d / "params").rglob("*") if p.is_file()]
    st = files[0].stat()
    os.utime(files[0], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a new mtime, same bytes
    load(d, "float32")
    assert len(reads) == 2 and dict(load.stats) == {"misses": 2}


def test_errors_are_the_loaders_own(tmp_path, memo):
    load, reads = memo
    with pytest.raises(checkpoint.CheckpointError, match="does not exist"):
        load(tmp_path / "nowhere")
    d = make_tiny_model_dir(tmp_path / "m")
    with pytest.raises(checkpoint.CheckpointError, match="unsupported dtype"):
        load(d, "int8")
    assert load.stats["uncached"] == 2 and not load.cache


def test_least_recently_used_entry_is_dropped(tmp_path, memo, monkeypatch):
    load, reads = memo
    monkeypatch.setattr(_model_cache, "MAX_ENTRIES", 2)
    dirs = [make_tiny_model_dir(tmp_path / f"m{i}", num_layers=1) for i in range(3)]
    for d in (dirs[0], dirs[1], dirs[0], dirs[2]):  # dirs[1] is the least recently used when dirs[2] comes
        load(d, "float32")
    assert len(load.cache) == 2 and len(reads) == 3
    load(dirs[0], "float32")
    load(dirs[1], "float32")
    assert len(reads) == 4 and load.stats["hits"] == 2
    monkeypatch.setattr(_model_cache, "MAX_BYTES", 1)  # over the byte bound: only the newest is kept
    load(dirs[2], "float32")
    assert list(load.cache) == [_model_cache.model_key(dirs[2], "float32")] and len(reads) == 5


def test_draft_heads_are_memoised(monkeypatch):
    """load_draft (the shipped EAGLE-3 head against the default model's config): one read per dtype,
    a head of its own per call."""
    from helpers import default_model_or_skip

    from specjax.assets import DEFAULT_HEAD_DIR
    real = getattr(checkpoint.load_draft, "real", checkpoint.load_draft)
    reads = []
    real_flat = checkpoint.load_draft_flat
    monkeypatch.setattr(checkpoint, "load_draft_flat", lambda *a, **k: reads.append(a[0]) or real_flat(*a, **k))
    load = _model_cache.Memo(real, _model_cache.draft_key)
    tcfg = checkpoint.load_config(default_model_or_skip())
    h1, c1 = load(DEFAULT_HEAD_DIR, tcfg, "float32")
    h2, c2 = load(DEFAULT_HEAD_DIR, tcfg, dtype="float32")
    load(DEFAULT_HEAD_DIR, tcfg, "bfloat16")
    assert len(reads) == 2 and dict(load.stats) == {"misses": 2, "hits": 1}
    assert c1 == c2 and h1 is not h2 and h1.lm_head is not h2.lm_head
    assert np.array_equal(np.asarray(h1.lm_head[...]), np.asarray(h2.lm_head[...]))


def test_engines_on_one_cached_checkpoint(tmp_path, memo, monkeypatch):
    """Two LLMs on one checkpoint through the memo: one read; their weights are the same immutable
    buffers, which running both engines (plain and speculative) leaves alive: the engine donates none."""
    from specjax import LLM
    from specjax.tree import SpecConfig
    load, reads = memo
    monkeypatch.setattr(checkpoint, "load_model", load)  # LLM imports it from the module when built
    d = make_tiny_model_dir(tmp_path / "m")
    a = LLM(d, dtype="float32", max_batch=1, max_seq_len=32)
    b = LLM(d, dtype="float32", max_batch=1, max_seq_len=32, draft="self",
            spec=SpecConfig(method="draft", num_steps=2))
    assert len(reads) == 1 and dict(load.stats) == {"misses": 1, "hits": 1}
    ptrs = [{w.unsafe_buffer_pointer() for w in llm.engine.weights} for llm in (a, b)]
    assert ptrs[0] == ptrs[1] and len(ptrs[0]) == len(a.engine.weights) > 0
    params = {"max_tokens": 6, "temperature": 0.0}
    out_a, out_b = a.generate(["w5 w17 w3"], params), b.generate(["w5 w17 w3"], params)
    assert out_a[0].token_ids == out_b[0].token_ids and len(out_a[0].token_ids) == 6
    assert not any(w.is_deleted() for w in a.engine.weights + b.engine.weights)
    assert a.generate(["w5 w17 w3"], params)[0].token_ids == out_a[0].token_ids
    load(d, "float32")
    assert len(reads) == 1 and load.stats["hits"] == 2
