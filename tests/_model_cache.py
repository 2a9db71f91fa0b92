"""A per-process memo of specjax.checkpoint.load_model / load_draft for the test suite.

Many tests build an LLM or an engine on the same checkpoint (the converted SmolLM2 above all); each
load_model of it took ~3 s on 2 cores (orbax restore ~1.3 s, building the abstract nnx model ~1.9 s),
again in every module fixture and CLI run of a test process (pytest-xdist workers run many files).
tests/conftest.py installs this memo: a test process loads a given checkpoint once.

Key: the requested dtype and a fingerprint of the directory (its resolved path; config.json,
specjax.json and params/**: inode, size, mtime, ctime), so a rewritten or touched checkpoint is read
again. A hit returns nnx.clone of the cached module: new module objects and Variables over the same
immutable jax.Arrays (a buffer copy would cost ~0.35 s of the ~3 s). So attention.configure, the
in-place nnx.update of sharding.shard_model or a test's `p[...] = x` reach the clone only. The
engine donates no weights (programs.py, step.py, decode.py donate the device state only); should a
cached buffer be deleted anyway (a donation, Array.delete), the checkpoint is read again. The cached
module itself is never handed out. Anything unusual (a missing directory, a bad dtype) goes to the
real loader uncached, so its errors are the library's own.

SPECJAX_TEST_LOAD_CACHE=0 turns it off.
"""
from __future__ import annotations

import collections
import functools
import os
import threading
from pathlib import Path

# bounds per process: SmolLM2 is ~270 MB in float32. Tiny checkpoints (tmp_path, rarely loaded twice)
# weigh little: a count bound well above a file's tiny loads (test_convert.py: 15) lets them not push
# SmolLM2 out between two files that use it
MAX_ENTRIES = 64
MAX_BYTES = 1 << 30


def fingerprint(model_dir) -> tuple:
    """The resolved path and (name, inode, size, mtime_ns, ctime_ns) of every file that load_model
    reads. Raises OSError where the directory is not there."""
    root = Path(model_dir).resolve(strict=True)
    files = [root / "config.json", root / "specjax.json"]
    files += sorted(p for p in (root / "params").rglob("*") if p.is_file())
    rows = []
    for p in files:
        if p.exists():
            st = p.stat()
            rows.append((str(p.relative_to(root)), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return (str(root), tuple(rows))


class Memo:
    """real(*args, **kw) memoised on key_fn(*args, **kw); the least recently used results are dropped
    past MAX_ENTRIES or MAX_BYTES (the newest is kept). Each call gets _clone of the result.
    stats: hits, misses, uncached (key_fn raised: the real loader runs and raises its own error)."""

    def __init__(self, real, key_fn):
        self.real, self.key_fn = real, key_fn
        self.cache: collections.OrderedDict = collections.OrderedDict()
        self.stats = collections.Counter()
        self.lock = threading.Lock()  # LLMs built on other threads (servers) load one at a time
        functools.update_wrapper(self, real)

    def __call__(self, *args, **kw):
        try:
            key = self.key_fn(*args, **kw)
        except Exception:  # noqa: BLE001 - a missing directory, a bad dtype: the library's own error
            self.stats["uncached"] += 1
            return self.real(*args, **kw)
        with self.lock:
            return _clone(self._get(key, args, kw))

    def _get(self, key, args, kw):
        if key in self.cache and _alive(self.cache[key]):
            self.stats["hits"] += 1
            self.cache.move_to_end(key)
        else:
            self.stats["misses"] += 1
            self.cache.pop(key, None)
            self.cache[key] = self.real(*args, **kw)  # an error propagates, nothing is stored
            while len(self.cache) > 1 and (len(self.cache) > MAX_ENTRIES or _nbytes(self.cache) > MAX_BYTES):
                self.cache.popitem(last=False)  # the least recently used
        return self.cache[key]


def _modules(result: tuple) -> list:
    from flax import nnx
    return [x for x in result if isinstance(x, nnx.Module)]


def _leaves(result: tuple) -> list:
    import jax
    from flax import nnx
    return [x for m in _modules(result) for x in jax.tree.leaves(nnx.state(m)) if isinstance(x, jax.Array)]


def _alive(result: tuple) -> bool:
    return not any(x.is_deleted() for x in _leaves(result))


def _nbytes(cache) -> int:
    return sum(x.nbytes for r in cache.values() for x in _leaves(r))


def _clone(result: tuple) -> tuple:
    """(cfg, module) or (module, cfg) with the module cloned (its buffers shared); configs are frozen."""
    from flax import nnx
    return tuple(nnx.clone(x) if isinstance(x, nnx.Module) else x for x in result)


def _dtype_key(dtype):
    from specjax.checkpoint import dtype_name
    return None if dtype is None else dtype_name(dtype)


def model_key(model_dir, dtype=None):
    return fingerprint(model_dir), _dtype_key(dtype)


def draft_key(draft_dir, target_cfg, dtype=None):
    hash(target_cfg)  # a frozen ModelConfig; an unhashable one is not cached
    return fingerprint(draft_dir), target_cfg, _dtype_key(dtype)


def install() -> None:
    """Wrap specjax.checkpoint.load_model / load_draft (their callers import them from the module
    when they run, or at test-module import, after conftest)."""
    if os.environ.get("SPECJAX_TEST_LOAD_CACHE", "1") == "0":
        return
    from specjax import checkpoint
    if not isinstance(checkpoint.load_model, Memo):
        checkpoint.load_model = Memo(checkpoint.load_model, model_key)
        checkpoint.load_draft = Memo(checkpoint.load_draft, draft_key)
