"""Grammar compilation bounded in time: constraints compile in a child process that is killed when a
compilation runs past its time limit, so a pathological JSON schema, regex or grammar fails its own
request (GrammarTimeout) and stalls neither the engine nor the other requests.

Flow (one BoundedGrammarCompiler per server):
  compile(key) --(cache hit)--> CompiledGrammar
      | miss: one job at a time
      v
  child process: GrammarCompiler(TokenizerInfo).compile(key) -> serialize_json   [limit: timeout s]
      | ok: CompiledGrammar.deserialize_json (cached, LRU)
      | GrammarError: re-raised with the child's reason
      | past the limit: the child is killed (its CPU and memory are reclaimed) and restarted on the
      |                 next job; the key's request gets GrammarTimeout
"""
from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

from specjax.grammar import GrammarCompiler, GrammarError

STARTUP_TIMEOUT_S = 300.0  # the child imports xgrammar and reads the vocabulary once


class GrammarTimeout(GrammarError):
    """Compiling the constraint took longer than the server allows."""


def _child(conn: Connection) -> None:
    """Child process: read (TokenizerInfo JSON, vocab size), then compile keys sent over conn, answering
    ("ok", serialized CompiledGrammar) or ("error", reason)."""
    import xgrammar as xg
    tokenizer_info_json, vocab_size = conn.recv()
    compiler = GrammarCompiler(xg.TokenizerInfo.deserialize_json(tokenizer_info_json), vocab_size, cache_size=0)
    conn.send(("ready", None))
    while True:
        try:
            key = conn.recv()
        except EOFError:
            return
        if key is None:
            return
        try:
            conn.send(("ok", compiler.compile(key).serialize_json()))
        except GrammarError as e:
            conn.send(("error", str(e)))
        except Exception as e:  # noqa: BLE001 - anything else xgrammar raises is about this key
            conn.send(("error", f"cannot compile {key[0]}: {type(e).__name__}: {e}"))


class BoundedGrammarCompiler:
    """compile(key) -> xgrammar.CompiledGrammar for the main process's TokenizerInfo, each compilation
    bounded by `timeout` seconds. Thread-safe (jobs run one at a time); call close() to stop the child."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, *, timeout: float = 10.0, cache_size: int = 64):
        if not timeout > 0:
            raise ValueError(f"grammar timeout must be > 0 seconds, got {timeout!r}")
        local = GrammarCompiler(tokenizer, vocab_size, stop_token_ids=list(stop_token_ids) or None)
        self.tokenizer_info = local.tokenizer_info
        self._local = local  # its token table serves the requests' grammar drafts
        self.vocab_size = vocab_size
        self.timeout = timeout
        self._info_json = self.tokenizer_info.serialize_json()
        self._proc = self._conn = None
        self._job = threading.Lock()  # one compilation at a time
        self._cache_lock = threading.Lock()
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_size = cache_size
        self.num_timeouts = 0
        self.num_compiled = 0
        self.last_compile_s: float | None = None

    @property
    def token_table(self):
        """The vocabulary's tokens by their bytes (specjax.grammar_drafts), built on first use."""
        return self._local.token_table

    def start(self) -> None:
        """Start the child now (otherwise on the first job); blocks until it is ready."""
        with self._job:
            self._ensure_child()

    def _ensure_child(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self._stop_child()
        # a fresh interpreter (no fork of a process holding JAX / XLA threads; no re-import of the
        # caller's __main__ as multiprocessing's spawn does), talking over a socket pair
        parent, child = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parent.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        proc = subprocess.Popen([sys.executable, "-m", "specjax.grammar_worker", str(child.fileno())],
                                pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, env=env)
        child.close()
        conn = Connection(parent.detach())
        conn.send((self._info_json, self.vocab_size))
        if not conn.poll(STARTUP_TIMEOUT_S):
            proc.kill()
            raise RuntimeError(f"the grammar worker did not start within {STARTUP_TIMEOUT_S:.0f} s")
        try:
            conn.recv()
        except EOFError:
            proc.wait(5)
            raise RuntimeError(f"the grammar worker exited at start (exit code {proc.returncode})") from None
        self._proc, self._conn = proc, conn

    def _stop_child(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(5)
            self._conn.close()
        self._proc = self._conn = None

    def _cached(self, key):
        with self._cache_lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def compile(self, key):
        """The CompiledGrammar of a constraint key; GrammarError (invalid) or GrammarTimeout (too slow).
        Cached keys return at once, even while another key compiles."""
        compiled = self._cached(key)
        if compiled is not None:
            return compiled
        with self._job:
            compiled = self._cached(key)
            if compiled is not None:
                return compiled
            self._ensure_child()
            t0 = time.perf_counter()
            self._conn.send(key)
            if not self._conn.poll(self.timeout):
                self._stop_child()
                self.num_timeouts += 1
                raise GrammarTimeout(f"compiling the {key[0]} constraint took longer than {self.timeout:g} s "
                                     f"(the server's limit); simplify it")
            try:
                status, payload = self._conn.recv()
            except EOFError:  # the child died (e.g. out of memory) on this key
                code = self._proc.wait(5)
                self._stop_child()
                raise GrammarError(f"compiling the {key[0]} constraint crashed the grammar worker "
                                   f"(exit code {code})") from None
            if status != "ok":
                raise GrammarError(payload)
            import xgrammar as xg
            compiled = xg.CompiledGrammar.deserialize_json(payload, self.tokenizer_info)
            self.num_compiled += 1
            self.last_compile_s = time.perf_counter() - t0
            with self._cache_lock:
                self._cache[key] = compiled
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            return compiled

    def close(self) -> None:
        with self._job:
            if self._conn is not None and self._proc.poll() is None:
                try:
                    self._conn.send(None)
                    self._proc.wait(2)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            self._stop_child()


if __name__ == "__main__":
    _child(Connection(int(sys.argv[1])))
