"""The host's delivery of a fused dispatch's K steps (specjax.engine_results): row b's tokens of step k are
toks[b][k][:n_k], taken by step index, and steps with n_k = 0 give nothing."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from specjax.engine_grammar import GrammarSteps
from specjax.engine_results import ResultSteps
from specjax.request import Request
from specjax.sampling_params import SamplingParams


class _Gate:
    def __init__(self):
        self.seen = []

    def observe(self, req, counts, after_lite):
        self.seen.append(list(counts))


def _engine(req):
    sched = SimpleNamespace(slots=[req], inflight=np.array([3]), sure=np.array([3]), lens=np.array([5]),
                            release=lambda slot: sched.slots.__setitem__(slot, None))
    eng = SimpleNamespace(sched=sched, gate=_Gate(), reported=[], cfg=SimpleNamespace(vocab_size=100),
                          kernels="Kernels(test)")
    eng._report = lambda r, toks=(): eng.reported.append(list(toks))
    eng._fail_running = lambda r, why: GrammarSteps._fail_running(eng, r, why)
    return eng


def _request(max_tokens=20):
    return Request(0, None, [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                   tokenizer=None, eos_ids=(0,), max_seq_len=64, seed=0)


def test_tokens_are_taken_by_step_index():
    """Counts [2, 0, 3]: the tokens of steps 0 and 2 (not of steps 0 and 1); lengths and mirrors follow."""
    req = _request()
    eng = _engine(req)
    toks = [[[10, 11, -1, -1], [-1, -1, -1, -1], [20, 21, 22, -1]]]  # [B=1][K=3][S+1=4]
    e = SimpleNamespace(kind="spec", advance=3, sure=3, after_lite=False, succ_slots=frozenset())
    ResultSteps._accept(eng, e, [(0, 0, req, req.epoch)], toks, None, None, None, [[2, 0, 3]], None)
    assert req.token_ids == [10, 11, 20, 21, 22]
    assert eng.reported == [[10, 11, 20, 21, 22]]
    assert req.accept_lens == [2, 3]
    assert int(eng.sched.lens[0]) == 10 and int(eng.sched.inflight[0]) == 0 and int(eng.sched.sure[0]) == 0


def test_trailing_idle_steps_give_nothing():
    """A row that finished on the device after step 0: its later steps (n = 0, tokens -1) add nothing."""
    req = _request(max_tokens=3)
    eng = _engine(req)
    toks = [[[7, 8, 9, -1], [-1, -1, -1, -1], [-1, -1, -1, -1]]]
    e = SimpleNamespace(kind="spec", advance=3, sure=3, after_lite=False, succ_slots=frozenset())
    ResultSteps._accept(eng, e, [(0, 0, req, req.epoch)], toks, None, None, None, [[3, 0, 0]], None)
    assert req.token_ids == [7, 8, 9] and req.finished
    assert eng.sched.slots[0] is None  # released on finishing


def test_token_ids_outside_the_vocabulary_fail_the_request():
    """A device fault that returns ids outside [0, vocab) fails that request with an error naming it (its slot
    freed), instead of the detokenizer raising inside the engine for every request."""
    req = _request()
    req.slot = 0
    eng = _engine(req)
    toks = [[[10, -1, -1, -1], [3, 4, -1, -1]]]
    e = SimpleNamespace(kind="spec", advance=2, sure=2, after_lite=False, succ_slots=frozenset())
    ResultSteps._accept(eng, e, [(0, 0, req, req.epoch)], toks, None, None, None, [[2, 2]], None)
    assert req.finished and req.finish_reason == "error"
    assert "outside the vocabulary [0, 100)" in req.error and "[-1]" in req.error
    assert req.token_ids == [] and eng.sched.slots[0] is None and eng.reported == [[]]
    big = _request()
    eng = _engine(big)
    ResultSteps._accept(eng, e, [(0, 0, big, big.epoch)], [[[5, 100, -1, -1], [1, -1, -1, -1]]], None, None, None,
                        [[2, 1]], None)
    assert big.finish_reason == "error" and "[100]" in big.error


def test_handed_over_steps_go_to_the_slot_that_ran_them():
    """Row hand-over: a row ran slot 0's request for steps 0-1 and slot 1's (its successor) for step 2:
    each request gets its own steps' tokens; the successor's slot has no sure steps to give back."""
    first, second = _request(max_tokens=5), _request()
    eng = _engine(first)
    s = eng.sched
    s.slots.append(second)
    s.inflight, s.sure, s.lens = np.array([3, 3]), np.array([3, 0]), np.array([5, 5])
    toks = [[[10, 11, 12, -1], [13, 14, -1, -1], [20, 21, -1, -1]]]
    e = SimpleNamespace(kind="spec", advance=3, sure=3, after_lite=False, succ_slots=frozenset({1}))
    rows = [(0, 0, first, first.epoch), (0, 1, second, second.epoch)]
    ResultSteps._accept(eng, e, rows, toks, None, None, None, [[3, 2, 2]], None, [[0, 0, 1]])
    assert first.token_ids == [10, 11, 12, 13, 14] and first.finished and s.slots[0] is None
    assert second.token_ids == [20, 21] and second.accept_lens == [2]
    assert int(s.lens[1]) == 7 and int(s.inflight[1]) == 0 and int(s.sure[1]) == 0
