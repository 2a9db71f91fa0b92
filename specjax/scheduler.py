"""Host-side scheduling for the engine: the request queue, slot assignment, the KV page budget
(admission, reservation for the next step, preemption) and bucketed batch shapes. No device work.

Lengths: `lens[slot]` is the slot's device sequence length after the last step whose results the
host has read; `inflight[slot]` is the most that the dispatched but unread steps may add to it (the
one-step-behind loop reserves pages for step t+1 before it reads step t, so it reserves for the
upper bound lens + inflight + ahead); `sure[slot]` is the fewest tokens those steps give the slot's
request (or it finished): a request they certainly finish is left out of the next step (`stepping`).

Capacity: a slot addresses `capacity` cache entries, max_seq_len plus `tail` rounded up to pages. A
speculative step writes its draft tree (node i at cache index L + i, while it sits at position
L + depth[i]) and the draft's scratch entries up to `lookahead` entries past the slot's length L, which
can be max_seq_len - 1 when the last token of the context is generated: the engine passes
tail = lookahead, so every entry a step writes is addressable and the output equals plain decoding up
to the end of the context. Plain decoding writes only at L < max_seq_len (tail = 0).

Prefill (`plan_prefill`): each engine step prefills at most `max_prefill_tokens` (rows x padded
length) in one call. A prompt longer than that is prefilled in chunks over several steps while the
running requests keep decoding (chunked prefill); a slot is `prefilling` until its last chunk has
been dispatched, and decodes from the step after. With prefix caching, an admitted request first
shares the cached pages of its longest cached prefix (specjax.prefix_cache) and prefills only the
rest; every page that a dispatched chunk completes is registered for later requests.

Preemption: when a running request cannot get the pages of its next step, the youngest running
request (by arrival) is retracted: its slot and pages are freed and it goes back to the front of
the queue, where it is prefilled again from its prompt plus the tokens it has generated (its
output continues where it stopped; the tokens of steps still in flight for it are dropped, since
its `epoch` changes). A request that cannot fit even alone fails with an error instead.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections import deque

import numpy as np

from specjax import prefix_cache
from specjax.kv_cache import PageAllocator
from specjax.request import Request

MIN_PREFILL_LEN = 16  # prefill lengths are padded to a power of two >= this


@dataclasses.dataclass(frozen=True)
class SchedulerOptions:
    async_loop: bool = True  # dispatch step t+1 before reading step t (False: the synchronous reference)
    admit_ahead: bool = True  # a full batch whose rows are expected to finish with the dispatches in flight
    #                           gives their slots to queued requests before reading them (specjax.engine_ahead)
    admit_early: bool = False  # admission ahead right after the dispatch expected to finish the rows (not
    #                            at the next step): the next request's prefill queues behind it; off: on an H200
    #                            no faster at batch 1, 6x the misses (specjax.engine_ahead, docs/benchmarks.md)
    handover: bool | None = None  # a speculative engine gets a spare slot per row where the next request is
    #                               prefilled ahead; a fused dispatch's row runs it once its request ends
    #                               (specjax.engine_handover). None: on for one row (max_batch 1) of a single-
    #                               device asynchronous engine without tree tiers (resolve_boundary), off otherwise
    unread: int | None = None  # dispatches the host leaves unread after a step (async_loop): 1, the one just made
    #                  (the host reads one step behind); 2 also the one before it, so that a step's longer host work
    #                  (a request boundary's prefill) runs over two dispatches of queued device work (steps with
    #                  host-grammar rows read every dispatch first, as before). None: 2 with hand-over for one
    #                  row (max_batch 1, the case measured), else 1
    overlap: bool = True  # grammars: compute the masks while the target forward runs (plain and speculative)
    grammar_drafts: bool = True  # grammar + speculation with a draft model / head: draft the grammar's
    #                              continuations into the trees (specjax.grammar_drafts; the n-gram drafter
    #                              takes none)
    mask_threads: int | None = None  # host threads for grammar masks (None: grammar_masks.default_threads())
    device_dfa: bool = True  # regex / choice / JSON-schema constraints as token DFAs followed on the device
    #                          (specjax.device_dfa: no host work per token); those that do not compile or exceed
    #                          the limits below take the host grammar path, counted (Engine.stats: dfa_fallbacks)
    dfa_max_states: int = 512  # static shape limits of the per-slot DFA tables (next [S, C] int32 per slot:
    dfa_max_classes: int = 256  # 512 KiB); JSON schemas need ~15 states per string field (bench_engine's: 164)

    def __post_init__(self):
        def positive(v):
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1
        for name in ("dfa_max_states", "dfa_max_classes"):
            if not positive(getattr(self, name)):
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.unread is not None and not positive(self.unread):
            raise ValueError(f"unread must be an int >= 1 or None, got {self.unread!r}")
        if self.handover is not None and not isinstance(self.handover, bool):
            raise ValueError(f"handover must be True, False or None (automatic), got {self.handover!r}")

    def resolve_boundary(self, speculative: bool, max_batch: int, tiers: bool, mesh: bool) -> "SchedulerOptions":
        """These options with handover and unread decided (their None: automatic). Hand-over is on by
        default for a speculative engine of one row (max_batch 1) that is asynchronous, on one device
        (no mesh) and without tree tiers, and then the host leaves two dispatches unread: on an H100
        (docs/benchmarks.md, session 43) the batch-1 probe ran 16 x 256 tokens in 1.33 s this way against
        1.48 s with hand-over alone and 1.62 s with neither, and the eval at batch 1 ran 2.98x plain.
        Larger batches keep admission ahead and one unread dispatch (hand-over doubles the slots there, and
        neither was measured there), also where hand-over is asked for."""
        handover = self.handover
        if handover is None:
            handover = speculative and max_batch == 1 and self.async_loop and not tiers and not mesh
        unread = self.unread if self.unread is not None else (2 if handover and speculative and max_batch == 1 else 1)
        return dataclasses.replace(self, handover=handover, unread=unread)


def slot_pages(entries: int, page_size: int) -> int:
    """Pages of one slot's page table to address `entries` cache entries."""
    return -(-entries // page_size)


@dataclasses.dataclass
class Piece:
    """One row of a prefill call: tokens ids[start:end] of the request in `slot`; the cache holds
    ids[:start]. `final`: the last piece (it samples the first output token)."""
    slot: int
    req: Request
    ids: list[int]  # what the admission prefills (prompt + tokens generated before a preemption)
    start: int
    end: int
    first: bool  # the first piece of this admission
    regrow: bool = False  # a catch-up piece ending before x_L that grows a new tree (specjax.spec_tiers)

    @property
    def final(self) -> bool:
        return self.end == len(self.ids)


@dataclasses.dataclass
class PrefixStats:
    """Prefix-cache counters since the engine started."""
    queries: int = 0  # admissions that looked up their prefix
    hits: int = 0  # admissions that reused at least one page
    queried_tokens: int = 0  # tokens of the looked-up sequences
    hit_tokens: int = 0  # tokens whose K/V were reused
    prefill_tokens: int = 0  # tokens actually prefilled (all admissions)


def bucket(n: int, lo: int, hi: int) -> int:
    """The smallest lo * 2^k >= n, capped at hi when hi >= n (few distinct shapes, few programs)."""
    b = lo
    while b < n:
        b *= 2
    return min(b, hi) if hi >= n else b


class Scheduler:
    def __init__(self, *, num_pages: int, page_size: int, max_seq_len: int, max_batch: int,
                 max_prefill_tokens: int, ahead: int, advance: int, tail: int = 0, prefix_caching: bool = False,
                 key_shift: int = 0, prefill_chunk: int | None = None, max_rows: int | None = None):
        """ahead: cache entries one step may touch past a slot's length (pages to hold);
        advance: the most one step adds to a slot's length; tail: cache entries a slot needs past
        max_seq_len (a speculative engine: its lookahead). prefix_caching: share the KV pages of
        cached prefixes; key_shift: tokens after a page that its content depends on (the draft's
        shift, specjax.prefix_cache); prefill_chunk: the longest piece of one prompt in a prefill call
        (None: max_prefill_tokens). max_batch: the slots; max_rows: the most rows a decode step runs (None:
        max_batch); the other prefilled slots wait, `parked` (row hand-over: specjax.engine_handover)."""
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.max_seq_len, self.max_batch = max_seq_len, max_batch
        self.max_rows = max_batch if max_rows is None else max_rows
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_chunk = prefill_chunk or max_prefill_tokens  # checked by BatchOptions
        self.prefix_caching, self.key_shift = prefix_caching, key_shift
        self.prefix = PrefixStats()
        self.ahead, self.advance = ahead, advance
        self.pages_per_slot = slot_pages(max_seq_len + tail, page_size)
        self.alloc = PageAllocator(num_pages, page_size, self.pages_per_slot, max_batch)
        self.capacity = self.pages_per_slot * page_size  # cache entries one slot can address
        self.queue: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * max_batch
        self.lens = np.zeros(max_batch, np.int64)
        self.inflight = np.zeros(max_batch, np.int64)
        self.sure = np.zeros(max_batch, np.int64)  # tokens the unread steps give each slot at least
        self.num_preempted = 0
        self._arrivals = itertools.count()
        # slots whose prefill is not complete: slot -> (ids, page keys, pages registered so far)
        self.prefilling: dict[int, tuple[list[int], list[bytes], int]] = {}

    # -- queries ------------------------------------------------------------------------------
    def running(self) -> list[tuple[int, Request]]:
        """(slot, request) of the occupied slots, in slot order."""
        return [(i, r) for i, r in enumerate(self.slots) if r is not None]

    def _prefilled(self) -> list[tuple[int, Request]]:
        return [(i, r) for i, r in enumerate(self.slots) if r is not None and i not in self.prefilling]

    def decoding(self) -> list[tuple[int, Request]]:
        """The running slots whose prefill is complete (they take part in decode steps): the max_rows
        oldest by arrival, in slot order."""
        done = self._prefilled()
        if len(done) <= self.max_rows:
            return done
        return sorted(sorted(done, key=lambda x: x[1].arrival)[: self.max_rows])

    def parked(self) -> list[tuple[int, Request]]:
        """Prefilled slots beyond the max_rows decoding ones, oldest first (they wait for a row)."""
        return sorted(self._prefilled(), key=lambda x: x[1].arrival)[self.max_rows:]

    def stepping(self) -> list[tuple[int, Request]]:
        """The decoding slots the next step can still give tokens: not those whose dispatched steps
        certainly finish them (at least `sure` more tokens reach max_len; the host reads one step
        behind, so such a row would otherwise run a whole step past its end)."""
        return [(i, r) for i, r in self.decoding() if len(r.token_ids) + self.sure[i] < r.max_len]

    @property
    def chunk(self) -> int:
        """The longest piece of one prefill call (prefill lengths are buckets up to it)."""
        return max(MIN_PREFILL_LEN, min(self.max_prefill_tokens, self.prefill_chunk, self.max_seq_len))

    def prefill_len(self, n: int) -> int:
        """Padded length of a prefill call whose longest piece has n tokens."""
        return bucket(n, MIN_PREFILL_LEN, self.chunk)

    def uncached_len(self, p: Piece) -> int:
        """The piece's length had the prefix cache not held its prompt: a first piece that reused
        every page it could (its whole prompt was prefilled before: a repeat) counts its prefill
        from 0 up to a chunk, other pieces (new text after a cached prefix included) their own."""
        ps = self.alloc.page_size
        most = prefix_cache.max_shared_pages(len(p.ids), ps, self.key_shift) * ps
        repeat = p.first and 0 < p.start == most
        return min(p.end, self.chunk) if repeat else p.end - p.start

    def has_work(self) -> bool:
        return bool(self.queue) or any(r is not None for r in self.slots)

    def _pages(self, length: int) -> int:
        return -(-min(length, self.capacity) // self.alloc.page_size)

    def never_fits(self, req: Request) -> str | None:
        """Why the request can never run here (None if it can)."""
        n = len(req.prefill_ids)
        if n >= self.max_seq_len:
            return (f"prompt has {n} tokens; max_seq_len={self.max_seq_len} leaves no room to generate "
                    "(the prompt must be shorter than max_seq_len)")
        need, have = self._pages(n + self.ahead), self.alloc.num_pages - 1
        if need > have:
            return (f"request needs {need} KV pages of {self.alloc.page_size} tokens, the cache has {have}: "
                    "raise num_pages or lower max_seq_len")
        return None

    def _target(self, slot: int) -> int:
        """Cache entries the slot must have pages for before the next step is dispatched: what the
        unread steps may add plus one more step, at most what the request can use (its last step
        starts below len(prompt) + max_len; entries a finished row's stale step writes past its
        pages go to the trash page)."""
        req = self.slots[slot]
        most = self.capacity if req is None else len(req.prompt_ids) + req.max_len + self.ahead
        return min(int(self.lens[slot] + self.inflight[slot]) + self.ahead, self.capacity, most)

    def rows_bucket(self, n: int, min_rows: int = 2) -> int:
        """The padded row count of a step over n rows (a power-of-two bucket >= min_rows)."""
        return bucket(max(n, min_rows), min_rows, max(min_rows, self.max_rows))

    def row_slots(self, rows: list[tuple[int, Request]], min_rows: int = 2,
                  num_rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(slots [B], active [B]) for a step over rows; B is bucketed (>= min_rows) unless num_rows
        (>= len(rows)) gives it; padding rows get slot max_batch (out of range: reads clamp, writes
        drop)."""
        B = self.rows_bucket(len(rows), min_rows) if num_rows is None else num_rows
        if B < len(rows):
            raise ValueError(f"num_rows={B} is fewer than the {len(rows)} rows of the step")
        slots = np.full(B, self.max_batch, np.int32)
        slots[: len(rows)] = [s for s, _ in rows]
        return slots, np.arange(B) < len(rows)

    # -- changes ------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.arrival = next(self._arrivals)
        self.queue.append(req)

    def remove_queued(self, req: Request) -> bool:
        try:
            self.queue.remove(req)
            return True
        except ValueError:
            return False

    def release(self, slot: int) -> None:
        """Free a slot and its pages (request finished, cancelled, failed or preempted)."""
        req = self.slots[slot]
        if req is not None:
            req.slot = None
        self.slots[slot] = None
        self.alloc.release(slot)
        self.prefilling.pop(slot, None)
        self.lens[slot] = self.inflight[slot] = self.sure[slot] = 0

    def plan_prefill(self, max_running: int | None = None) -> list[Piece]:
        """The pieces of this step's prefill call: the next chunk of each unfinished prefill (oldest
        first), then queued requests admitted into free slots (FCFS) while the token budget
        (rows x padded length <= max_prefill_tokens) and the pages last. An admitted request gets
        pages for its whole prefill plus one step, after those it shares from the prefix cache;
        pages the running requests need for their next step are kept back, so that admission
        rarely forces a preemption. The pages the pieces complete are registered for reuse.
        max_running: admit only while fewer slots than this are running (None: any free slot)."""
        pieces: list[Piece] = []
        longest = 0

        def fits(n: int) -> bool:
            return not pieces or (len(pieces) + 1) * self.prefill_len(max(longest, n)) <= self.max_prefill_tokens

        for slot in sorted(self.prefilling, key=lambda s: self.slots[s].arrival):
            ids = self.prefilling[slot][0]
            start = int(self.lens[slot])
            n = min(len(ids) - start, self.chunk)
            if not fits(n):
                break
            pieces.append(Piece(slot, self.slots[slot], ids, start, start + n, first=False))
            longest = max(longest, n)
        free = [i for i, r in enumerate(self.slots) if r is None]
        if max_running is not None:
            free = free[: max(0, max_running - sum(r is not None for r in self.slots))]
        held = sum(self.alloc.pages_needed(s, self._target(s)) for s, _ in self.running())
        while self.queue and free:
            req = self.queue[0]
            ids = req.prefill_ids
            keys = prefix_cache.page_keys(ids, self.alloc.page_size, self.key_shift) if self.prefix_caching else []
            ps = self.alloc.page_size
            shared = self.alloc.lookup(keys[: prefix_cache.max_shared_pages(len(ids), ps, self.key_shift)])
            start = len(shared) * ps
            n = min(len(ids) - start, self.chunk)
            if not fits(n):
                break
            slot, length = free[0], min(len(ids) + self.ahead, self.capacity)
            need = -(-length // ps) - len(shared) + self.alloc.num_cached_in(shared)  # pages leaving the free count
            if need + held > self.alloc.num_free:
                break
            self.alloc.share(slot, shared)
            if not self.alloc.ensure(slot, length):  # cannot happen after the check above; stay consistent
                self.alloc.release(slot)
                break
            self.queue.popleft()
            free.pop(0)
            self.slots[slot] = req
            req.slot = slot
            self.inflight[slot] = self.sure[slot] = 0
            if not req.num_preempted:
                req.num_cached_tokens = start
            self.prefilling[slot] = (ids, keys, len(shared))
            pieces.append(Piece(slot, req, ids, start, start + n, first=True))
            longest = max(longest, n)
            if self.prefix_caching:
                st = self.prefix
                st.queries, st.queried_tokens = st.queries + 1, st.queried_tokens + len(ids)
                st.hits, st.hit_tokens = st.hits + bool(shared), st.hit_tokens + start
        for p in pieces:
            self._dispatched(p)
        return pieces

    def _dispatched(self, p: Piece) -> None:
        """Book a piece as dispatched: the slot's length, the pages it completes, the end of the prefill."""
        self.lens[p.slot] = p.end
        self.prefix.prefill_tokens += p.end - p.start
        ids, keys, done = self.prefilling[p.slot]
        upto = min(len(keys), p.end // self.alloc.page_size)  # pages whose K/V (target and draft) are now written
        for j in range(done, upto):
            self.alloc.register(p.slot, j, keys[j])
        if p.final:
            del self.prefilling[p.slot]
        else:
            self.prefilling[p.slot] = (ids, keys, max(done, upto))

    def preempt(self, slot: int) -> Request:
        req = self.slots[slot]
        self.release(slot)
        self.requeue(req)
        return req

    def requeue(self, req: Request) -> None:
        """Put a request that lost its slot back at the front of the queue, to be re-admitted (its
        prompt and tokens prefilled again); outputs of steps dispatched for it so far are dropped."""
        req.epoch += 1
        req.num_preempted += 1
        self.num_preempted += 1
        self.queue.appendleft(req)

    def ensure_extra(self, slots: list[int], extra: int) -> bool:
        """Pages for `extra` more cache entries past each slot's reservation, for all the slots or
        (when the free pages do not cover them all) for none: True if taken."""
        want = {s: min(self._target(s) + extra, self.capacity) for s in slots}
        if sum(self.alloc.pages_needed(s, n) for s, n in want.items()) > self.alloc.num_free:
            return False
        return all([self.alloc.ensure(s, n) for s, n in want.items()])

    def reserve(self) -> list[Request]:
        """Pages for the next step of every running slot (oldest request first), preempting the
        youngest when pages run out. Returns the requests that cannot run even alone (their slots
        are freed; the caller fails them)."""
        failed = []
        for slot, req in sorted(self.running(), key=lambda x: x[1].arrival):
            while self.slots[slot] is req and not self.alloc.ensure(slot, self._target(slot)):
                others = [(s, r) for s, r in self.running() if r is not req]
                youngest = max(others, key=lambda x: x[1].arrival, default=None)
                if youngest is not None and youngest[1].arrival > req.arrival:
                    self.preempt(youngest[0])
                elif others:  # the request itself is the youngest: it waits in the queue
                    self.preempt(slot)
                else:
                    self.release(slot)
                    failed.append(req)
        return failed
