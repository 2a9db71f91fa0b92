"""Kernel implementations are chosen once, at engine start and outside traced code (specjax.kernels):
"auto" probes on GPU only and says why it settles for the reference; a forced implementation is
used, or raises when it cannot compile (never replaced silently); the choice is part of the
programs' static configuration (what runs inside them) and is reported on the engine's info line,
the "specjax" logger and the CLI's stderr."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_config, tiny_model
from tiny_dir import make_tiny_model_dir

from pallas_kernels import kv_compact as kvc
from specjax import cli, kernels, programs as prog
from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.kernels import KernelError, Kernels, choose_kv_compact, compact_shapes
from specjax.tree import SpecConfig

TREE = SpecConfig(method="draft", num_steps=2, topk=2, num_draft_tokens=3)


def _args():
    return compact_shapes(2, (9, 4, 2, 2, 8), jnp.float32, rows=2, pages_per_slot=4, accepted=3)


def test_auto_off_gpu_is_the_reference_without_probing(monkeypatch):
    if jax.default_backend() == "gpu":
        pytest.skip("checks the choice off GPU")
    monkeypatch.setattr(kvc, "compile_error", lambda *a: pytest.fail("probed a kernel off GPU"))
    impl, note = choose_kv_compact("auto", _args())
    assert impl == "reference" and "runs Pallas kernels only interpreted" in note


def test_auto_on_gpu_takes_the_first_that_compiles_and_says_why_not(monkeypatch, caplog):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for ok, want in [({"mosaic", "pallas"}, "mosaic"), ({"mosaic:pallas_call", "pallas"}, "mosaic:pallas_call"),
                     ({"pallas"}, "pallas")]:
        monkeypatch.setattr(kvc, "compile_error", lambda name, *a, ok=ok: None if name in ok else f"Boom: {name}")
        impl, note = choose_kv_compact("auto", _args())
        assert impl == want and note.startswith("auto")
    monkeypatch.setattr(kvc, "compile_error", lambda name, *a: f"Boom: {name} failed\ntraceback")
    with caplog.at_level(logging.WARNING, logger="specjax"):
        impl, note = choose_kv_compact("auto", _args())
    assert impl == "reference"
    for name in kernels.GPU_ORDER:  # nobody is left to guess why the slow path runs
        assert f"{name} does not compile: Boom: {name} failed" in note
    assert "no kernel compiles" in caplog.text


def test_forced_implementations(monkeypatch):
    assert choose_kv_compact("reference", _args()) == ("reference", "forced")
    if jax.default_backend() != "gpu":  # a real failure: Mosaic GPU on CPU
        with pytest.raises(KernelError, match="'mosaic' was asked for but does not compile.*needs a GPU backend"):
            choose_kv_compact("mosaic", _args())
    monkeypatch.setattr(kvc, "compile_error", lambda name, *a: "Boom" if name == "pallas" else None)
    with pytest.raises(KernelError, match="'pallas' was asked for"):  # forced: no fallback
        choose_kv_compact("pallas", _args())
    assert choose_kv_compact("mosaic:pallas_call", _args()) == ("mosaic:pallas_call", "forced")
    with pytest.raises(ValueError, match="must be one of"):
        choose_kv_compact("triton", _args())
    assert cli.KV_COMPACT_CHOICES == kernels.KV_COMPACT_CHOICES  # the CLI offers exactly these
    assert cli.DRAFT_TOPK_CHOICES == kernels.DRAFT_TOPK_CHOICES


@pytest.fixture(scope="module")
def models():
    cfg = tiny_config()
    return cfg, tiny_model(cfg, seed=0)


def _engine(models, spec=TREE, **kw):
    cfg, target = models
    return Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=32), BatchOptions(max_batch=2), jnp.float32,
                  draft=Draft(target, cfg, DraftInfo("draft"), spec), **kw)


def _traced_compactions(eng, monkeypatch) -> list[str]:
    """The kv_compact implementations the engine's fused step runs, once per trace of the step
    (traced, not compiled)."""
    seen = []
    ref = kvc.kv_compact_reference
    for name, fn in (("reference", kvc.kv_compact_reference), ("pallas", kvc.kv_compact_pallas)):
        def spy(*a, name=name, **kw):
            seen.append(name)
            return ref(*a)
        monkeypatch.setattr(kvc, fn.__name__, spy)
    slots, active = eng.sched.row_slots([])
    eng.spec_steps.step.lower(eng.weights, eng.draft_weights, eng.state, eng.samp, slots, active, None,
                              prog.no_stop(len(slots)), num_steps=1, want_logprobs=False, stochastic=False)
    monkeypatch.undo()
    return seen


def test_engine_chooses_once_reports_and_runs_its_choice(models, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="specjax"):
        eng = _engine(models)
    want = "reference" if jax.default_backend() != "gpu" else eng.kernels.kv_compact
    assert eng.kernels == Kernels(kv_compact=want)
    assert f"kv_compact={want} (auto" in eng.info and eng.info in caplog.text
    assert "lookahead" in eng.info and f"{eng.sched.capacity} cache entries" in eng.info
    if want == "reference":
        assert set(_traced_compactions(eng, monkeypatch)) == {"reference"}
    # forced: the programs are built with it (no global is read when they are traced)
    monkeypatch.setattr(kvc, "compile_error", lambda *a: None)  # pretend the Triton kernel compiles here
    forced = _engine(models, kv_compact_impl="pallas")
    monkeypatch.undo()
    assert forced.kernels == Kernels(kv_compact="pallas") and "kv_compact=pallas (forced)" in forced.info
    assert set(_traced_compactions(forced, monkeypatch)) == {"pallas"}


def test_forced_kernel_that_cannot_compile_raises(models):
    if jax.default_backend() == "gpu":
        pytest.skip("Mosaic GPU may compile here")
    with pytest.raises(KernelError, match="mosaic"):
        _engine(models, kv_compact_impl="mosaic")
    with pytest.raises(ValueError, match="kv_compact_impl must be one of"):
        _engine(models, kv_compact_impl="fast")


def test_chains_and_plain_decoding_compact_nothing(models):
    chain = _engine(models, SpecConfig(method="draft", num_steps=2), kv_compact_impl="mosaic")  # not used: no error
    assert "kv_compact=not used (chain; 'mosaic' was asked for)" in chain.info
    cfg, target = models
    plain = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=32), BatchOptions(max_batch=2), jnp.float32)
    assert "kv_compact=not used (plain decoding)" in plain.info


def test_cli_reports_and_forces(tmp_path, capsys):
    tiny = make_tiny_model_dir(tmp_path / "model", num_layers=2)
    argv = ["generate", "--model", str(tiny), "--prompt", "w5 w6 w7", "--raw", "--max-tokens", "3",
            "--max-seq-len", "32", "--max-batch", "2", "--draft", "self", "--num-steps", "2", "--topk", "2"]
    if jax.default_backend() != "gpu":
        assert cli.main(argv + ["--kv-compact-impl", "mosaic"]) == 2
        err = capsys.readouterr().err
        assert "kv_compact implementation 'mosaic' was asked for but does not compile" in err
    assert cli.main(argv + ["--kv-compact-impl", "reference", "--draft-topk", "reduce"]) == 0
    err = capsys.readouterr().err
    assert "speculative (draft: num_steps=2 topk=2" in err and "kv_compact=reference (forced)" in err
    assert "draft top-k: reduce" in err
    assert np.all([line.startswith("specjax: ") or line.startswith("[") for line in err.splitlines()])
