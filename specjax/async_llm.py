"""Asynchronous API: one Engine driven by one background thread, requests streamed to asyncio callers.

    async for delta in AsyncLLM(dtype="float32").generate("Hello", SamplingParams(max_tokens=8)):
        print(delta.text, end="")

Data flow:
  asyncio loop (callers, the HTTP server)          engine thread (the only one touching the Engine's
                                                   state; prepare_dfa only fills its DFA cache)
  add_request(prompt, params)
    LLM._request: tokenize + validate   -- bad: RequestError (nothing reaches the engine)
    constraint: BoundedGrammarCompiler (child process, time limit) -> req.grammar, then the device DFA
                (Engine.prepare_dfa, a worker thread)
    inbox <- ("add", req, stream)  ---------------->  engine.add_request(req)
                                                      loop: engine.step() -> [StepUpdate]
    RequestStream (asyncio.Queue)  <-- call_soon_threadsafe(RequestDelta: text, tokens, logprobs)
  stream.cancel() (client gone, generator closed)
    inbox <- ("cancel", id)  ---------------------->  engine.cancel(id): slot and pages freed now
The engine thread blocks on the inbox while the engine is idle. EngineStats is written by the engine
thread after every step (counters, queue / slot / page gauges) and only read elsewhere.
"""
from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
import traceback
from collections import Counter
from collections.abc import AsyncIterator

from specjax.request import RequestOutput
from specjax.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError", "EngineStats", "RequestDelta", "RequestError", "RequestStream"]


class RequestError(ValueError):
    """A request that cannot be served (bad prompt, parameters or constraint); the message says why."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or an internal error); no request can be served."""


@dataclasses.dataclass
class RequestDelta:
    """New output of one request. The texts of a request's deltas concatenate to its final text; its
    last delta has finish_reason ("stop" | "length" | "error" | "cancelled") and output set."""
    request_id: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per new token {token id: logprob}, the sampled token first
    finish_reason: str | None = None
    error: str | None = None
    output: RequestOutput | None = None


TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)  # seconds


@dataclasses.dataclass
class EngineStats:
    """Counters since start and gauges after the last engine step (written by the engine thread).
    `engine` is the engine's own Engine.stats() of that moment (KV pages, prefix cache, prefills)."""
    finished: Counter = dataclasses.field(default_factory=Counter)  # requests by finish_reason
    generation_tokens: int = 0
    spec_steps: int = 0  # speculative steps of finished requests
    spec_tokens: int = 0  # tokens those steps emitted (tau = spec_tokens / spec_steps)
    engine_steps: int = 0
    running: int = 0
    waiting: int = 0
    kv_pages_used: int = 0  # distinct pages held by requests (a page shared through the prefix cache: once)
    kv_pages_total: int = 0
    engine: dict = dataclasses.field(default_factory=dict)
    # time to first token, measured in this process, by phase (seconds summed over first tokens):
    # "prepare" add_request until queued (validation, tokenization, constraint compile), "pickup" queued
    # until the engine thread takes it (it was inside a step), "engine" taken until its first token is
    # handed to the caller's loop (waiting for the running dispatch, prefill, reading the result)
    ttft_count: int = 0
    ttft_phase_s: Counter = dataclasses.field(default_factory=Counter)
    ttft_hist: Counter = dataclasses.field(default_factory=Counter)  # first tokens by TTFT_BUCKETS bound

    def observe_first_token(self, stamps: dict) -> None:
        """A request's first token: stamps {received, queued, taken, first} (time.perf_counter())."""
        self.ttft_count += 1
        for phase, a, b in (("prepare", "received", "queued"), ("pickup", "queued", "taken"),
                            ("engine", "taken", "first")):
            self.ttft_phase_s[phase] += stamps[b] - stamps[a]
        total = stamps["first"] - stamps["received"]
        for le in TTFT_BUCKETS:
            if total <= le:
                self.ttft_hist[le] += 1

    def observe(self, engine, waiting_outside: int) -> None:
        st = engine.stats()
        self.running = st["running"]
        self.waiting = st["queue_length"] + waiting_outside
        self.kv_pages_used, self.kv_pages_total = st["pages_in_use"], st["pages_total"]
        self.engine = st  # a new dict each time: readers see one step's figures


class RequestStream:
    """The deltas of one submitted request, as an async iterator. cancel() (or closing the iterator
    of AsyncLLM.generate) cancels the request in the engine."""

    def __init__(self, req, loop: asyncio.AbstractEventLoop, inbox: queue.SimpleQueue):
        self.request_id = req.id
        self.prompt_token_ids = list(req.prompt_ids)
        self.output: RequestOutput | None = None
        self._loop, self._inbox = loop, inbox
        self._queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self._done = False
        self.stamps: dict[str, float] = {}  # time to first token by phase (EngineStats.observe_first_token)

    @property
    def finished(self) -> bool:
        return self._done

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestDelta:
        if self._done:
            raise StopAsyncIteration
        delta = await self._queue.get()
        if delta.finish_reason is not None:
            self._done, self.output = True, delta.output
        return delta

    def cancel(self) -> None:
        """Cancel the request unless it has finished (safe to call more than once)."""
        if not self._done:
            self._done = True
            self._inbox.put(("cancel", self.request_id))

    def _deliver(self, delta: RequestDelta) -> bool:
        """Engine thread: hand a delta to the caller's loop. False if that loop is gone."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, delta)
            return True
        except RuntimeError:  # the caller's event loop is closed
            return False


class AsyncLLM:
    def __init__(self, llm=None, *, grammar_timeout: float = 10.0, **llm_kwargs):
        """llm: a specjax.LLM to serve (it must not be used directly while this runs), or None to build
        one from llm_kwargs (LLM's arguments). grammar_timeout: seconds one constraint may take to
        compile before its request fails (a pathological schema or regex)."""
        if llm is None:
            from specjax.llm import LLM
            llm = LLM(**llm_kwargs)
        elif llm_kwargs:
            raise TypeError(f"give an LLM or LLM arguments, not both ({sorted(llm_kwargs)})")
        if llm.process_index != 0:
            raise RuntimeError(f"AsyncLLM takes requests on JAX process 0; process {llm.process_index} runs "
                               "them with llm.follow()")
        self.llm = llm
        self.engine = llm.engine
        self.grammar_timeout = grammar_timeout
        self.stats = EngineStats()
        self.stats.observe(self.engine, 0)
        self.error: str | None = None  # why the engine thread stopped
        self._grammar = None
        self._grammar_init = threading.Lock()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, RequestStream] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="specjax-engine", daemon=True)
        self._thread.start()

    # -- caller side (asyncio) ----------------------------------------------------------------
    @property
    def speculative(self) -> bool:
        return self.engine.draft is not None

    @property
    def max_seq_len(self) -> int:
        return self.llm.max_seq_len

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    async def add_request(self, prompt, params: SamplingParams | dict | None = None, *, index: int = 0,
                          max_prompt_tokens: int | None = None) -> RequestStream:
        """Validate, tokenize and compile the request's constraint, then queue it. prompt: a string or
        a list of token ids. Raises RequestError with the reason for a request that cannot be served,
        EngineDeadError once the engine has stopped. `index` numbers the prompt in error messages;
        max_prompt_tokens: a limit below the context's."""
        if self.error is not None:
            raise EngineDeadError(self.error)
        received = time.perf_counter()
        try:
            req = self.llm._request(prompt, params or SamplingParams(), index)
        except (TypeError, ValueError) as e:
            raise RequestError(str(e)) from None
        if req.finished:
            raise RequestError(req.error)
        if max_prompt_tokens is not None and len(req.prompt_ids) > max_prompt_tokens:
            raise RequestError(f"prompt {index} has {len(req.prompt_ids)} tokens, more than this server's limit "
                               f"of {max_prompt_tokens}")
        if req.params.constraint is not None:
            from specjax.grammar import GrammarError, RequestGrammar
            try:
                compiled, table = await asyncio.to_thread(self._compile, req.params.constraint)
                req.grammar = RequestGrammar(compiled, list(req.eos_ids) or None, token_table=table)
            except (GrammarError, ValueError) as e:
                raise RequestError(str(e)) from None
            await asyncio.to_thread(self.engine.prepare_dfa, req)  # the device DFA, off the engine thread
        stream = RequestStream(req, asyncio.get_running_loop(), self._inbox)
        stream.stamps.update(received=received, queued=time.perf_counter())
        self._inbox.put(("add", req, stream))
        return stream

    async def generate(self, prompt, params: SamplingParams | dict | None = None) -> AsyncIterator[RequestDelta]:
        """Stream one request's RequestDeltas; leaving the loop early (break, exception, task
        cancellation) cancels the request."""
        stream = await self.add_request(prompt, params)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.cancel()

    def _compiler(self):
        with self._grammar_init:
            if self._grammar is None:
                from specjax.grammar_worker import BoundedGrammarCompiler
                self._grammar = BoundedGrammarCompiler(self.llm.tokenizer, self.llm.cfg.vocab_size,
                                                       self.llm.eos_ids, timeout=self.grammar_timeout)
            return self._grammar

    def _compile(self, key):
        """(compiled grammar, the vocabulary's token table for grammar drafts)."""
        compiler = self._compiler()
        return compiler.compile(key), compiler.token_table

    def start_grammar_worker(self) -> None:
        """Build the tokenizer's grammar tables and start the compile worker now rather than on the
        first constrained request (blocking: a server calls it in a thread at start)."""
        self._compiler().start()
        self._compiler().token_table  # noqa: B018 - built now, not on the first request

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread (requests still running end with an error) and the grammar worker."""
        if self._thread.is_alive():
            self._inbox.put(("stop",))
            self._thread.join(timeout)
        if self._grammar is not None:
            self._grammar.close()

    # -- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                cmd = self._next_command()
                if cmd is None and not self.engine.has_unfinished():
                    cmd = self._inbox.get()  # idle: sleep until there is work
                while cmd is not None:
                    if cmd[0] == "stop":
                        self._stop("the server is shutting down")
                        return
                    self._apply(cmd)
                    cmd = self._next_command()
                if self.engine.has_unfinished():
                    self._publish(self.engine.step())
                    self.stats.engine_steps += 1
                self.stats.observe(self.engine, self._inbox.qsize())
        except BaseException as e:  # noqa: BLE001 - every waiting caller must hear of it
            traceback.print_exc()
            self._stop(f"engine error: {type(e).__name__}: {e}")

    def _next_command(self):
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _apply(self, cmd) -> None:
        if cmd[0] == "add":
            _, req, stream = cmd
            stream.stamps["taken"] = time.perf_counter()
            self._streams[req.id] = stream
            self.engine.add_request(req)
        elif cmd[0] == "cancel":
            self.engine.cancel(cmd[1])

    def _publish(self, updates) -> None:
        for upd in updates:
            req = upd.request
            self.stats.generation_tokens += len(upd.token_ids)
            if req.finished:
                self.stats.finished[req.finish_reason] += 1
                self.stats.spec_steps += len(req.accept_lens)
                self.stats.spec_tokens += sum(req.accept_lens)
            stream = self._streams.get(req.id)
            if stream is None:
                continue
            tokens = list(upd.token_ids)
            logprobs = None if req.logprobs is None else req.logprobs[len(req.logprobs) - len(tokens):]
            text = req.take_text_delta()
            if not (text or tokens or req.finished):
                continue
            delta = RequestDelta(req.id, text, tokens, logprobs, req.finish_reason, req.error,
                                 req.output() if req.finished else None)
            if tokens and "first" not in stream.stamps and "taken" in stream.stamps:
                stream.stamps["first"] = time.perf_counter()
                self.stats.observe_first_token(stream.stamps)
            if req.finished:
                del self._streams[req.id]
            if not stream._deliver(delta) and not req.finished:
                del self._streams[req.id]
                self.engine.cancel(req.id)

    def _stop(self, reason: str) -> None:
        """Fail every request still streaming, free their slots, refuse new ones."""
        self.error = reason
        while (cmd := self._next_command()) is not None:
            if cmd[0] == "add":
                self._streams[cmd[1].id] = cmd[2]
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.cancel(rid)
            except Exception:  # noqa: BLE001 - the engine may be what failed
                pass
            stream._deliver(RequestDelta(rid, "", [], None, "error", reason))
        self._streams.clear()
        try:
            self.stats.observe(self.engine, 0)
        except Exception:  # noqa: BLE001
            pass
