"""scripts/tune_autotune.py: choosing the fastest trial and installing its autotune results (the trials
themselves are GPU compilations)."""
import json

import pytest

from helpers import load_script


def _load():
    return load_script("tune_autotune")


def test_pick_takes_the_fastest_trial_that_ran():
    mod = _load()
    trials = [{"us_per_step": 1390.0}, {"error": "trial exited with 1"}, {"us_per_step": 1342.5},
              {"us_per_step": 1351.0}]
    assert mod.pick(trials) == 2
    assert mod.pick([{"error": "x"}]) is None
    assert mod.pick([]) is None


def test_install_copies_the_picks_and_drops_stale_executables(tmp_path):
    mod = _load()
    trial, cache = tmp_path / "trial1", tmp_path / "cache"
    (trial / mod.AUTOTUNE_DIR / "v1").mkdir(parents=True)  # XLA nests its results in a directory
    (trial / mod.AUTOTUNE_DIR / "v1" / "fusion_a").write_text("new a")
    (trial / mod.AUTOTUNE_DIR / "v1" / "fusion_b").write_text("new b")
    (cache / mod.AUTOTUNE_DIR / "v1").mkdir(parents=True)
    (cache / mod.AUTOTUNE_DIR / "v1" / "fusion_a").write_text("old a")
    (cache / mod.AUTOTUNE_DIR / "v1" / "fusion_c").write_text("old c")  # another program's fusion: kept
    for name in ("jit_fused-1-cache", "jit_fused-1-atime", "jit_prefill-2-cache"):
        (cache / name).write_text("executable")
    copied, removed = mod.install(trial, cache)
    assert (copied, removed) == (2, 3)
    tuned = {p.name: p.read_text() for p in (cache / mod.AUTOTUNE_DIR / "v1").iterdir()}
    assert tuned == {"fusion_a": "new a", "fusion_b": "new b", "fusion_c": "old c"}
    assert [p.name for p in cache.iterdir()] == [mod.AUTOTUNE_DIR]


def test_install_without_results_changes_nothing(tmp_path):
    mod = _load()
    (tmp_path / "trial0").mkdir()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "jit_fused-1-cache").write_text("executable")
    assert mod.install(tmp_path / "trial0", cache) == (0, 0)
    assert (cache / "jit_fused-1-cache").exists()  # no picks to read: the compiled programs stay valid


def test_target_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    mod = _load()
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("SPECJAX_COMPILE_CACHE", str(tmp_path / "c"))
    assert mod.target_cache_dir() == tmp_path / "c"
    monkeypatch.setenv("SPECJAX_COMPILE_CACHE", "off")
    assert mod.target_cache_dir() is None
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "j"))
    assert mod.target_cache_dir() == tmp_path / "j"


@pytest.mark.parametrize("args", [["--trials", "0"], ["--reps", "0"], ["--engine", "draft"]])
def test_arguments_are_checked(args):
    with pytest.raises(SystemExit):
        _load().main(args)
