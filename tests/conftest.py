"""Session setup: 8 host (CPU) devices, so that sharding tests can build meshes on a CPU-only machine;
a persistent compilation cache of this run only.

Must run before the JAX backend initialises (pytest imports conftest before the test modules).
Everything that does not ask for a mesh keeps running on the default device, jax.devices()[0].
An explicit device count from the environment (JAX_NUM_CPU_DEVICES or the XLA flag) wins.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import warnings

NUM_CPU_DEVICES = 8
_FLAG = "--xla_force_host_platform_device_count"

# Tests never read or write the user's compilation cache: unless the environment names one (or
# "off"), the run gets its own, a fresh temporary directory made by the first process (pytest, or
# pytest-xdist's controller: its workers and the processes tests start inherit the variable) and
# removed when that process's session ends. A program that several tests compile alike is compiled
# once and loaded by the others (the whole suite on 2 cores: 51 -> 45-47 min; most tests' programs differ).
# tests/test_compile_cache.py runs its own processes with caches of their own.
_OWN_CACHE = None
if "SPECJAX_COMPILE_CACHE" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="specjax-test-jax-cache-")
    os.environ["SPECJAX_COMPILE_CACHE"] = _OWN_CACHE

# Tests compile hundreds of small programs whose run time is tiny: XLA's backend at optimisation level 0
# without LLVM's expensive passes compiles them faster (session 36, 2 cores: a speculative engine test
# 45.6 -> 28.4 s, tree tests 41.7 -> 30.2 s, interpreted Mosaic attention 84.9 -> 67.1 s; a real-SmolLM2 test,
# whose programs' run time counts, 57.1 -> 76.4 s; level 1 or 2 with the passes off gain little: 36-38 s for
# the first); the whole suite 56:16 -> 43:58 with the checkpoint memo (tests/_model_cache.py). Outputs are
# compared within one run (speculative against plain, kernels against references), never against
# figures from another build; an environment that names the level keeps its own choice.
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_FAST_COMPILE]).strip()

_user_set = "JAX_NUM_CPU_DEVICES" in os.environ or _FLAG in os.environ.get("XLA_FLAGS", "")

import jax  # noqa: E402 - after reading the environment, before any backend exists

if not _user_set:
    try:
        jax.config.update("jax_num_cpu_devices", NUM_CPU_DEVICES)
    except AttributeError:  # older jax without the option: the XLA flag, read when the backend starts
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}={NUM_CPU_DEVICES}".strip()
    except RuntimeError as e:  # a backend already exists: multi-device tests will skip
        warnings.warn(f"could not set {NUM_CPU_DEVICES} CPU devices: {e}", stacklevel=1)


# A test process builds hundreds of small engines; each build thawing the frozen heap (its default,
# so that a dropped engine's buffers are freed before the next allocates) cost ~0.7 s here: a dropped
# engine waits up to a minute instead (tests/test_compile_once.py checks both settings).
from specjax import compile_watch  # noqa: E402

compile_watch.RECLAIM_EVERY_S = 60.0

# A test process loads a given checkpoint once: load_model / load_draft memoised (tests/_model_cache.py).
import _model_cache  # noqa: E402

_model_cache.install()


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:  # the process that made the run's cache (not an xdist worker)
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# The slowest test files (2 cores, session 34's run with --durations) run first: pytest-xdist's
# --dist loadfile hands files to idle workers in collection order, so a heavy file collected last ran
# alone on one core at the end of the run (its last ~5 % took ~11 minutes). Other files follow in
# their usual order; a name missing here only loses its place. (Starting test_device_dfa.py after
# test_cli_llm.py, so that it might load test_grammar_engine.py's alike programs from the run's
# compilation cache, was tried in session 35: the suite then took 56:16 against 47:41 in session 34,
# not shown to be the cause; reverted.)
HEAVY_FIRST = ("test_grammar_engine.py", "test_device_dfa.py", "test_spec_tiers.py", "test_cli_llm.py",
               "test_sharding_spec.py", "test_spec_smollm2.py", "test_grammar_smollm2.py",
               "test_paged_attention_interpreters.py", "test_scheduler_spec.py",
               "test_train.py", "test_eval.py", "test_spec_eagle.py", "test_tree.py", "test_adaptive_spec.py",
               "test_server_spec.py", "test_prefix_chunk_smollm2.py", "test_adaptive_steps.py",
               "test_bench_dfa_mask.py", "test_server.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))  # stable: each file's own order is kept
