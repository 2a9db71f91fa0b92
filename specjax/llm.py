"""The user-facing Python API: `LLM(...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import random
import weakref
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp

from specjax import multihost
from specjax.adaptive import NGRAM_MIN_ACCEPT, check_min_accept
from specjax.engine import BatchOptions, CacheOptions, Engine, check_speculate_below
from specjax.request import Request, RequestOutput
from specjax.sampling_params import SamplingParams, SamplingParamsError
from specjax.scheduler import SchedulerOptions
from specjax.token_cache import PromptEncoder

log = logging.getLogger("specjax")

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


class PromptError(ValueError):
    """A prompt given with the wrong types (not a string or a list of int token ids). Prompts that are
    well-typed but cannot be served (empty, too long, token ids outside the vocabulary) fail only
    their own request: finish_reason "error" with the reason in RequestOutput.error."""


@dataclasses.dataclass
class StreamDelta:
    """One streaming event of LLM.generate_stream: new text / tokens of the prompt at `index`."""
    index: int  # position of the prompt in the generate_stream call
    request_id: int
    text: str  # new text (the deltas of a request concatenate to its final text)
    token_ids: list[int]  # new tokens
    finish_reason: str | None = None  # set on the request's last event
    error: str | None = None
    output: RequestOutput | None = None  # the final output, on the last event


def default_spec(draft, kind: str, max_batch: int, **override):
    """The tree shape when none is given: the draft's measured spec_defaults for max_batch
    (checkpoint.head_spec_defaults), else a chain of 4; `override`: SpecConfig fields set on top
    (e.g. ngram_branch)."""
    from specjax.checkpoint import head_spec_defaults
    from specjax.tree import SpecConfig
    found = None if draft in ("self", "ngram") else head_spec_defaults(draft, max_batch)
    if found is None:
        return SpecConfig(method=kind, **{"num_steps": 4, **override})
    kw, batch = found
    try:
        spec = SpecConfig(method=kind, **kw)
    except ValueError as e:
        raise ValueError(f"{draft}/specjax.json spec_defaults[{batch}]: {e}") from None
    log.info("speculation: num_steps=%d topk=%d num_draft_tokens=%d (the draft's spec_defaults for batch %d)%s",
             spec.num_steps, spec.topk, spec.num_draft_tokens, batch,
             "".join(f", {k}={v}" for k, v in override.items()))
    return dataclasses.replace(spec, **override) if override else spec


def default_tiers(draft, kind: str, max_batch: int):
    """The tree shapes by batch when none is given (specjax.spec_tiers): the draft's spec_defaults
    entries up to max_batch, or None when they give fewer than two."""
    from specjax.checkpoint import head_spec_tiers
    from specjax.spec_tiers import SpecTiers, describe
    from specjax.tree import SpecConfig
    pairs = [] if draft in ("self", "ngram") else head_spec_tiers(draft, max_batch)
    if len(pairs) < 2:
        log.warning("speculation: spec_tiers asked for, but %s's spec_defaults give one tree shape up to max_batch %d: "
                    "one shape runs", draft, max_batch)
        return None
    tiers = SpecTiers.of([(b, SpecConfig(method=kind, **kw)) for b, kw in pairs])
    log.info("speculation: tree shapes by batch (the draft's spec_defaults): %s", describe(tiers))
    return tiers


def draft_method(draft) -> str:
    """The SpecConfig.method a draft needs: "eagle" / "eagle3" for a converted head directory,
    "draft" for a draft model directory or "self", "ngram" for "ngram"."""
    import json

    from specjax.checkpoint import MARKER
    if draft == "ngram":
        return "ngram"
    marker = Path(draft) / MARKER
    if draft != "self" and marker.exists():
        kind = json.loads(marker.read_text()).get("kind", "draft")
        if kind in ("eagle", "eagle3"):
            return kind
    return "draft"


def resolve_speculate_below(value, draft) -> int | None:
    """LLM(speculate_below=value) for a draft (None: plain decoding) -> BatchOptions.speculate_below:
    "auto" reads the draft's measurements (checkpoint.head_speculate_below; "self" / "ngram": none)."""
    if value == "auto":
        if draft is None or draft in ("self", "ngram"):
            return None
        from specjax.checkpoint import head_speculate_below
        below = head_speculate_below(draft)
        if below is not None:
            log.info("speculation: plain steps for batches of >= %d rows (the draft's spec_defaults: plain decoding "
                     "measured faster from batch %d on)", below, below)
        return below
    check_speculate_below(value)  # before any weights are loaded
    if value is not None and draft is None:
        raise ValueError(f"speculate_below={value} needs speculative decoding (a draft)")
    return value


def resolve_min_accept(value, draft, max_batch: int) -> float | None:
    """LLM(min_accept=value) -> BatchOptions.min_accept (specjax.adaptive): "auto" is the n-gram
    drafter's measured break-even for "ngram", a draft directory's spec_defaults "min_accept" for
    max_batch (checkpoint.head_min_accept), else None (no gate)."""
    if value == "auto":
        if draft == "ngram":
            return NGRAM_MIN_ACCEPT
        if draft is None or draft == "self":
            return None
        from specjax.checkpoint import head_min_accept
        return head_min_accept(draft, max_batch)
    check_min_accept(value)
    if value is not None and draft is None:
        raise ValueError(f"min_accept={value} needs speculative decoding (a draft)")
    return value


class LLM:
    def __init__(self, model: str | Path | None = None, dtype: str = "auto", page_size: int = 16,
                 max_batch: int = 8, max_seq_len: int = 2048, num_pages: int | None = None, seed: int = 0,
                 draft: str | Path | None = None, spec=None, tensor_parallel: int = 1,
                 scheduler: SchedulerOptions | None = None, kv_compact_impl: str = "auto", attention="auto",
                 prefix_cache: bool = True, max_prefill_tokens: int = BatchOptions.max_prefill_tokens,
                 prefill_chunk: int = BatchOptions.prefill_chunk,
                 steps_per_call: int = BatchOptions.steps_per_call,
                 spec_steps_per_call: int = BatchOptions.spec_steps_per_call, adaptive_steps: bool = False,
                 speculate_below: int | None | str = "auto", min_accept: float | None | str = "auto",
                 fused_min_rows: int = BatchOptions.fused_min_rows, draft_topk: str = "auto",
                 spec_tiers: bool = False):
        """dtype: "auto" (float32 on the CPU, bfloat16 on GPUs and TPUs), "bfloat16" or "float32".
        draft: None (plain decoding), "self" (the target drafts for itself: for testing), "ngram"
        (prompt lookup: drafts copied from the request's own text, no weights; specjax.ngram), the
        directory of a converted Llama-family draft model with the target's vocabulary, or of a
        converted EAGLE-1 / EAGLE-3 head (`specjax convert --draft`).
        spec: specjax.tree.SpecConfig (default: a chain of 4 drafted tokens with the draft's method);
        SpecConfig(method="ngram", ...) without a draft selects the n-gram drafter.
        tensor_parallel: shard heads / MLP / vocabulary / KV heads over this many devices.
        scheduler: SchedulerOptions (default: the one-step-behind async loop, grammar overlap on).
        kv_compact_impl: KV compaction of accepted tree paths: "auto" (chosen once at start: a GPU
        kernel that compiles, else the jnp reference), or "reference" / "pallas" / "mosaic" /
        "mosaic:pallas_call" to force one (raises if it does not compile). `llm.engine.info` (logged at
        INFO on the "specjax" logger) says which one runs. draft_topk: the draft tree's per-level top-k,
        "auto" (one variadic reduction on GPU, lax.top_k elsewhere), "xla" or "reduce"; the same results.
        attention: paged-attention implementation ("auto": the Mosaic GPU kernel on Hopper (cuDNN
        for plain decoding with max_batch 1 and on other GPUs), the TPU kernel on TPU, the jnp
        reference on CPU; see specjax.attention); `LLM.engine.attention_choice` says which.
        prefix_cache: reuse the KV pages of prompt prefixes already computed (a shared system
        prompt, earlier turns); outputs are those without it.
        max_prefill_tokens: tokens (rows x padded length) of one prefill call (several prompts share it).
        prefill_chunk: the longest piece of one prompt in a prefill call; longer prompts are prefilled
        in chunks between the decode steps of running requests (their streams keep flowing).
        steps_per_call / spec_steps_per_call: plain / fused speculative steps per dispatch (fewer:
        a new request waits less for the running dispatch before its prefill; more: less host work).
        adaptive_steps: those halve (to a quarter) while the engine waits for the device and grow back
        while the host is busy (specjax.dispatch_plan.StepsCap; `specjax serve` turns it on): lower
        latency for arriving requests at light load (measured); meant to keep the full steps where the
        host is the bottleneck (saturation: not yet measured); the same outputs. A level whose program
        is not compiled for the batch's rows is compiled on a worker thread while the engine runs a
        compiled level (specjax.background_compile): changing levels never compiles on the engine thread.
        spec_tiers (with a draft, no spec): each speculative step runs the tree shape the draft's
        spec_defaults give for the batch running then (specjax.spec_tiers; lossless), not the one for
        max_batch. Off by default: on an H200 with the shipped head it was no faster (docs/benchmarks.md).
        speculate_below (with a draft): batches of this many rows or more run lite steps (plain
        decoding that keeps the draft in sync, switching back to speculation losslessly:
        specjax.dispatch_plan) instead of speculative ones; None: always speculate; "auto": from the
        draft's measurements (its specjax.json spec_defaults, checkpoint.head_speculate_below), else None.
        min_accept (with a draft): run lite steps while the rows' measured tokens per fused step stay
        below this break-even, probing with a fused dispatch now and then (specjax.adaptive; lossless);
        None: off; "auto": the n-gram drafter's measured break-even, a draft's spec_defaults
        "min_accept", else off.
        fused_min_rows: 1 (the default) lets a fused speculative dispatch of one request run without
        the padding row of plain decode dispatches; 2 pads it (see BatchOptions.fused_min_rows).
        Constrained requests (SamplingParams json_schema / regex / grammar / choice) compile with one
        specjax.grammar.GrammarCompiler built from the tokenizer on first use."""
        from specjax import compile_cache
        from specjax.checkpoint import check_converted, load_model, load_tokenizer
        from specjax.machine import log_backend, resolve_dtype
        compile_cache.enable()  # before anything compiles (SPECJAX_COMPILE_CACHE=off: not used)
        dtype = resolve_dtype(dtype)
        if spec_tiers and (draft is None or spec is not None):
            raise ValueError("spec_tiers=True runs the tree shapes of a draft's spec_defaults: it needs a draft and "
                             f"no explicit spec (got draft={draft!r}, spec={spec!r})")
        if draft is None and spec is not None:
            if spec.method != "ngram":
                raise ValueError(f"SpecConfig(method={spec.method!r}) needs a draft (LLM(draft=...)); only "
                                 "method='ngram' drafts without one")
            draft = "ngram"
        log_backend()
        if model is None:
            from specjax.default_model import ensure_default
            model = ensure_default()
        self.model_dir = check_converted(model, "model")
        if draft is not None and draft not in ("self", "ngram"):
            check_converted(draft, "draft")
        below = resolve_speculate_below(speculate_below, draft)
        gate = resolve_min_accept(min_accept, draft, max_batch)
        self.dtype = dtype
        mesh = None
        if tensor_parallel != 1:
            from specjax import sharding
            mesh = sharding.make_mesh(tensor_parallel)
            multihost.check_mesh(mesh)
            self.cfg, module = sharding.restore_sharded(self.model_dir, mesh, dtype=dtype)
        else:
            multihost.check_mesh(None)
            self.cfg, module = load_model(self.model_dir, dtype)
        self.tokenizer = load_tokenizer(self.model_dir)
        # prompt ids: the text between added tokens (a shared system prompt) cached where the tokenizer
        # qualifies (the same ids either way); the log line says which path runs
        self.prompt_encoder = PromptEncoder(self.tokenizer)
        log.info("prompt tokenization: %s", self.prompt_encoder.info)
        self.max_seq_len, self.max_batch = max_seq_len, max_batch
        self.spec = self.spec_tiers = None
        engine_draft = None
        if draft is not None:
            engine_draft = self._load_draft(draft, spec, module, dtype, spec_tiers)
        self.engine = Engine(module, self.cfg, CacheOptions(page_size, max_seq_len, num_pages, prefix_cache),
                             BatchOptions(max_batch, max_prefill_tokens, prefill_chunk, steps_per_call=steps_per_call,
                                          spec_steps_per_call=spec_steps_per_call, adaptive_steps=adaptive_steps,
                                          speculate_below=below, min_accept=gate, fused_min_rows=fused_min_rows),
                             DTYPES[dtype],
                             draft=engine_draft, mesh=mesh,
                             sched=scheduler, grammar=self._grammar_compiler, kv_compact_impl=kv_compact_impl,
                             attention=attention, draft_topk=draft_topk)
        if draft is not None and draft not in ("self", "ngram"):
            from specjax.checkpoint import measurement_note
            note = measurement_note(draft, self.engine.attention_name)
            if note:
                log.warning("speculation: %s", note)
        self._rng = random.Random(seed)
        self._next_id = 0
        self._follower = None  # multi-host, processes other than 0 (specjax.multihost)
        if multihost.is_multi_process():
            channel = multihost.new_channel()
            if channel.me == 0:
                self.engine.replica = multihost.Leader(channel)
                atexit.register(_close_at_exit, weakref.ref(self))
            else:
                self._follower = multihost.Follower(channel, self.engine, self._rebuild)

    def _default_spec(self, draft, kind):
        return default_spec(draft, kind, self.max_batch)

    def _load_draft(self, draft, spec, target_module, dtype, spec_tiers: bool = False):
        from specjax.checkpoint import load_model
        from specjax.drafter import DraftInfo
        from specjax.engine import Draft
        kind = draft_method(draft)
        tiers = None
        if spec is None:
            spec = self._default_spec(draft, kind)
            if spec_tiers:  # the shapes by the running batch
                tiers = default_tiers(draft, kind, self.max_batch)
        self.spec, self.spec_tiers = spec, tiers
        if self.spec.method != kind:
            raise ValueError(f"SpecConfig.method={self.spec.method!r} but the draft "
                             f"{'(the target itself)' if draft == 'self' else str(draft)} is a {kind!r} draft")
        if kind == "ngram":
            return Draft(None, None, DraftInfo("ngram"), self.spec)
        if kind != "draft":
            from specjax.checkpoint import load_draft
            head, ecfg = load_draft(draft, self.cfg, dtype)
            return Draft(head, ecfg.layer, DraftInfo(ecfg.method, tuple(ecfg.aux_layers)), self.spec, tiers)
        if draft == "self":
            return Draft(target_module, self.cfg, DraftInfo("draft"), self.spec, tiers)
        draft_cfg, draft_module = load_model(draft, dtype)
        if draft_cfg.vocab_size != self.cfg.vocab_size:
            raise ValueError(f"draft model {draft} has vocab_size {draft_cfg.vocab_size}, the target has "
                             f"{self.cfg.vocab_size}: a draft must share the target's vocabulary")
        return Draft(draft_module, draft_cfg, DraftInfo("draft"), self.spec, tiers)

    def stats(self) -> dict:
        """The engine's counters (Engine.stats): queue, KV pages, prefix-cache hit rate, ..."""
        return self.engine.stats()

    @property
    def eos_ids(self) -> tuple[int, ...]:
        ids = set(self.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def _grammar_compiler(self):
        from specjax.grammar import GrammarCompiler
        return GrammarCompiler(self.tokenizer, self.cfg.vocab_size, stop_token_ids=list(self.eos_ids))

    @staticmethod
    def _params(params, index: int) -> tuple[SamplingParams, str | None]:
        """(params, None) or (defaults, why the request's parameters are invalid). A SamplingParams is
        validated again (its fields may have changed since construction); a dict is built into one."""
        try:
            if isinstance(params, dict):
                return SamplingParams(**params), None
            if isinstance(params, SamplingParams):
                return dataclasses.replace(params), None
        except SamplingParamsError as e:
            return SamplingParams(), f"request {index}: {e}"
        raise TypeError(f"params {index} must be a SamplingParams or a dict, got {type(params).__name__}")

    def _request(self, prompt, params, index: int) -> Request:
        """A Request; one that cannot be served is returned already failed (finish_reason "error")."""
        params, why = self._params(params, index)
        if isinstance(prompt, str):
            text, ids = prompt, self.prompt_encoder.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
            if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
                raise PromptError(f"prompt {index}: token ids must be integers in [0, {self.cfg.vocab_size})")
        else:
            raise PromptError(f"prompt {index} must be a string or a list of token ids, got {type(prompt).__name__}")
        if why is None and not ids:
            why = f"prompt {index} is empty"
        if why is None and any(not 0 <= t < self.cfg.vocab_size for t in ids):
            why = f"prompt {index}: token ids must be integers in [0, {self.cfg.vocab_size})"
        if why is None and len(ids) >= self.max_seq_len:
            why = (f"prompt {index} has {len(ids)} tokens; max_seq_len={self.max_seq_len} leaves no room to "
                   "generate (prompt must be shorter than max_seq_len)")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        self._next_id += 1
        req = Request(self._next_id - 1, text, ids, params, self.tokenizer, self.eos_ids, self.max_seq_len,
                      seed & 0xFFFFFFFF)
        if why is not None:
            req.fail(why)
        return req

    def _requests(self, prompts, params) -> list[Request]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        return [self._request(p, sp, i) for i, (p, sp) in enumerate(zip(prompts, plist))]

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either. params: one SamplingParams for
        all, or one per prompt (a SamplingParams or a dict of its fields). A request that cannot be
        served (bad parameters, empty / too long prompt, invalid constraint) gets finish_reason "error"
        and its reason in `error`; the others run normally.
        Several JAX processes (specjax.multihost): call it on every process; process 0's prompts and
        params run (the others' are not used, e.g. None) and every process returns their outputs."""
        if self._follower is not None:
            reqs = []
            for ev in self._follower.replay():
                reqs += ev.added
            self._check_end(ev)
            return [r.output() for r in reqs]
        with self._call():
            reqs = self._requests(prompts, params)
            self.engine.run(reqs)
        return [r.output() for r in reqs]

    def generate_stream(self, prompts, params: SamplingParams | list[SamplingParams] | None = None
                        ) -> Iterator[StreamDelta]:
        """Like generate, but yields StreamDelta events as tokens arrive (one step of the engine at a
        time); each request's last event has finish_reason and output set. Closing the generator
        early cancels the requests still running. Several JAX processes: like generate (every process
        iterates; the others yield process 0's events)."""
        if self._follower is not None:
            yield from self._follow_stream()
            return
        with self._call():
            reqs = self._requests(prompts, params)
            index = {id(r): i for i, r in enumerate(reqs)}
            for r in reqs:
                self.engine.add_request(r)
            left = set(index)
            try:
                while left and self.engine.has_unfinished():
                    yield from _deltas(self.engine.step(), index, left)
            finally:
                for r in reqs:
                    if not r.finished:
                        self.engine.cancel(r.id)

    # -- several JAX processes (specjax.multihost) -----------------------------------------------
    @contextlib.contextmanager
    def _call(self):
        """One generate call of process 0; the other processes' call ends with it (and fails if it did)."""
        error = None
        try:
            yield
        except GeneratorExit:  # generate_stream closed early: its requests were cancelled
            raise
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            if self.engine.replica is not None:
                self.engine.replica.send("end", error)

    @staticmethod
    def _check_end(ev) -> None:
        if ev.then == "stop":
            raise multihost.LeaderStopped("process 0 closed its LLM (LLM.close) during a generate call")
        if ev.error is not None:
            raise RuntimeError(f"process 0's generate call failed: {ev.error}")

    def _follow_stream(self) -> Iterator[StreamDelta]:
        index, left = {}, set()
        events = self._follower.replay()
        try:
            for ev in events:
                for r in ev.added:
                    index[id(r)] = len(index)
                    left.add(id(r))
                yield from _deltas(ev.updates, index, left)
        finally:
            for ev in events:  # closed early here: keep in step with process 0 to the end of its call
                pass
        self._check_end(ev)

    def _rebuild(self, fields: dict) -> Request:
        """A follower's copy of a request of process 0 (multihost.request_fields)."""
        params = multihost.params_from(fields["params"])
        req = Request(fields["id"], fields["prompt"], fields["prompt_ids"], params, self.tokenizer, self.eos_ids,
                      self.max_seq_len, fields["seed"])
        if fields["error"] is not None:
            req.fail(fields["error"])
        return req

    @property
    def process_index(self) -> int:
        return 0 if self._follower is None else self._follower.channel.me

    def follow(self) -> None:
        """Processes other than 0: run process 0's requests (its LLM.generate calls, its AsyncLLM /
        `specjax serve`) until process 0 calls LLM.close. On process 0 (or one process): an error."""
        if self._follower is None:
            raise RuntimeError("LLM.follow() is for JAX processes other than 0 (process 0 takes the requests)")
        while True:
            for ev in self._follower.replay():
                pass
            if ev.then == "stop":
                return

    def close(self) -> None:
        """Process 0 of several: release the other processes from LLM.follow (once; the LLM then serves
        no more requests). Also run at interpreter exit. Elsewhere: nothing to do."""
        rep = self.engine.replica
        if rep is not None and not rep.closed:
            rep.send("stop")

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not self.tokenizer.chat_template:
            raise ValueError(f"the model at {self.model_dir} has no chat template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def chat(self, messages, params: SamplingParams | None = None):
        """messages: one conversation (list of {"role", "content"}) or a list of them. Several JAX
        processes: like generate (the others' messages only say whether one output is returned)."""
        single = bool(messages) and isinstance(messages[0], dict)
        convs = [messages] if single else messages
        outs = self.generate(None if self._follower is not None else [self.apply_chat_template(c) for c in convs],
                             params)
        return outs[0] if single else outs


def _deltas(updates, index: dict, left: set) -> Iterator[StreamDelta]:
    """The StreamDeltas of one engine step's updates for the requests in `left` (by id()), which are
    removed once finished; index: id(request) -> its position in the generate_stream call."""
    for upd in updates:
        r = upd.request
        if id(r) not in left:
            continue
        text = r.take_text_delta()
        if text or upd.token_ids or r.finished:
            yield StreamDelta(index[id(r)], r.id, text, list(upd.token_ids), r.finish_reason, r.error,
                              r.output() if r.finished else None)
        if r.finished:
            left.discard(id(r))


def _close_at_exit(ref) -> None:
    llm = ref()
    if llm is not None:
        try:
            llm.close()
        except Exception:  # noqa: BLE001 - the distributed runtime may be gone already
            pass
