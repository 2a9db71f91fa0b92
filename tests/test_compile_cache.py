"""JAX's persistent compilation cache (specjax.compile_cache): a second process running the same
LLM.generate loads every executable the first one compiled (cache hits, no misses), with the
directory given by SPECJAX_COMPILE_CACHE; "off" leaves JAX's cache unset."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax

from specjax import compile_cache
from tiny_dir import make_tiny_model_dir

REPO = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import json, sys, time
    import jax
    events = {}
    jax.monitoring.register_event_listener(lambda e, **kw: events.__setitem__(e, events.get(e, 0) + 1))
    from specjax import LLM, SamplingParams
    t = time.perf_counter()
    llm = LLM(sys.argv[1], dtype="float32", max_batch=2, max_seq_len=64)
    out = llm.generate(["w5 w17 w3", "w8 w9"], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
    print(json.dumps(dict(tokens=[o.token_ids for o in out], seconds=time.perf_counter() - t,
                          cache_dir=jax.config.jax_compilation_cache_dir,
                          hits=events.get("/jax/compilation_cache/cache_hits", 0),
                          misses=events.get("/jax/compilation_cache/cache_misses", 0))))
""")


def _run(model_dir, cache):
    env = dict(os.environ, SPECJAX_COMPILE_CACHE=str(cache), JAX_PLATFORMS="cpu",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",  # the tiny model compiles fast: store all
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_second_process_reuses_the_persistent_cache(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "model", num_layers=1)
    cache = tmp_path / "jax-cache"
    first = _run(model_dir, cache)
    assert first["cache_dir"] == str(cache)
    assert first["misses"] > 0 and first["hits"] == 0  # an empty cache: everything compiled and stored
    entries = [p for p in cache.iterdir() if p.name.endswith("-cache")]
    assert len(entries) >= 2, sorted(p.name for p in cache.iterdir())
    assert any(p.name.startswith("jit_prefill") for p in entries)
    second = _run(model_dir, cache)
    assert second["tokens"] == first["tokens"]
    assert second["misses"] == 0 and second["hits"] == first["misses"], (first, second)


def test_off_and_user_settings(monkeypatch, tmp_path):
    monkeypatch.setattr(compile_cache, "_done", False)
    monkeypatch.setattr(compile_cache, "_dir", compile_cache._dir)  # restored after the test
    monkeypatch.setenv(compile_cache.ENV, "off")
    with _config(None):  # as in a process where nothing configured JAX's cache (the test run's own
        assert compile_cache.enable() is None  # cache, tests/conftest.py, may be configured here)
        assert jax.config.jax_compilation_cache_dir is None
        assert compile_cache.enable() is None  # once per process
    # a directory the user configured for JAX is kept
    monkeypatch.setattr(compile_cache, "_done", False)
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "ours"))
    with _config(str(tmp_path / "theirs")):  # no compilation inside: JAX's cache stays uninitialised
        assert compile_cache.enable() == tmp_path / "theirs"
    assert not (tmp_path / "ours").exists()


class _config:
    """Set jax_compilation_cache_dir for a block (restored after)."""

    def __init__(self, value):
        self.value = value

    def __enter__(self):
        self.old = jax.config.jax_compilation_cache_dir
        jax.config.update("jax_compilation_cache_dir", self.value)

    def __exit__(self, *exc):
        jax.config.update("jax_compilation_cache_dir", self.old)


def test_default_dir_under_specjax_home(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJAX_HOME", str(tmp_path))
    assert compile_cache.default_dir() == tmp_path / "jax-cache"
