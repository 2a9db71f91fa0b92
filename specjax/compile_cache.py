"""JAX's persistent compilation cache, on by default: a new process loads the executables an
earlier one compiled (same program, JAX version, backend and flags) instead of compiling again.

    SPECJAX_COMPILE_CACHE   unset: $SPECJAX_HOME/jax-cache (default ~/.cache/specjax/jax-cache)
                            a directory: that one
                            off (or 0, false, no, none): specjax does not turn the cache on

`enable()` runs once per process, at the start of specjax.LLM and specjax.engine.Engine. JAX's own
settings win: a cache directory already configured (JAX_COMPILATION_CACHE_DIR, or
jax.config.update("jax_compilation_cache_dir", ...)) is kept, and so are
JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS and JAX_COMPILATION_CACHE_MAX_SIZE when set. Otherwise
executables that took at least MIN_COMPILE_SECS to compile are stored, and the directory is kept
under MAX_BYTES (least recently used entries evicted; this needs the `filelock` package, without
which the size is not capped). Works on CPU and GPU (jax 0.10.2 and 0.11.2 store CPU executables too).
"""
from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import jax

log = logging.getLogger(__name__)

ENV = "SPECJAX_COMPILE_CACHE"
OFF = ("off", "0", "false", "no", "none")
MIN_COMPILE_SECS = 0.5  # the engine's programs take seconds; eager one-op executables are not worth a file
MAX_BYTES = 4 << 30
_done = False
_dir: Path | None = None


def default_dir() -> Path:
    from specjax.default_model import cache_home
    return cache_home() / "jax-cache"


def enable() -> Path | None:
    """Turn the persistent cache on (once per process). -> its directory, or None when off."""
    global _done, _dir
    if _done:
        return _dir
    _done = True
    _dir = None  # off unless a directory is taken below
    configured = jax.config.jax_compilation_cache_dir
    if configured:  # set by the user (JAX_COMPILATION_CACHE_DIR or jax.config): theirs
        _dir = Path(configured)
        return _dir
    choice = os.environ.get(ENV, "").strip()
    if choice.lower() in OFF:
        log.info("persistent compilation cache off (%s=%s)", ENV, choice)
        return None
    path = Path(choice).expanduser() if choice else default_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("persistent compilation cache off: cannot create %s (%s); set %s to a writable "
                    "directory or to off", path, e, ENV)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ and importlib.util.find_spec("filelock") is not None:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    log.info("persistent compilation cache: %s", path)
    _dir = path
    return _dir
