"""Stop conditions (EOS, stop_token_ids, stop strings, max_tokens, context length) against a
brute-force reference: the unconstrained greedy continuation is computed once, then plain Python
decides where each condition must cut it."""
from __future__ import annotations

import random

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import IdTokenizer, tiny_config, tiny_model
from specjax.engine import BatchOptions, CacheOptions, Engine
from specjax.request import Request
from specjax.sampling_params import SamplingParams

MAX_SEQ = 64
FREE_TOKENS = 30  # length of the unconstrained continuations
PROMPT_LENS = (3, 11, 6, 20)


def brute_force(tokens, tokenizer, *, max_tokens, stop_ids=(), stops=(), room=None):
    """Where generation over the unconstrained `tokens` must end: (token_ids, text, finish_reason).
    Order of checks per new token: stop id, then stop strings, then the length limit."""
    limit = max_tokens if room is None else min(max_tokens, room)
    for n in range(1, len(tokens) + 1):
        out = list(tokens[:n])
        text = tokenizer.decode(out)
        if out[-1] in stop_ids:
            return out, text, "stop"
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return out, text[: min(hits)], "stop"
        if n >= limit:
            return out, text, "length"
    raise AssertionError("reference continuation too short for this case")


@pytest.fixture(scope="module")
def world():
    cfg = tiny_config()
    model = tiny_model(cfg, seed=3)
    eng = Engine(model, cfg, CacheOptions(page_size=8, max_seq_len=MAX_SEQ), BatchOptions(max_batch=4), jnp.float32)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, 96, n)] for n in PROMPT_LENS]
    free = [Request(i, None, p, SamplingParams(max_tokens=FREE_TOKENS, temperature=0, ignore_eos=True),
                    IdTokenizer(), (96,), MAX_SEQ, 0) for i, p in enumerate(prompts)]
    eng.run(free)
    refs = [r.token_ids for r in free]
    assert all(len(r) == FREE_TOKENS for r in refs)
    assert all(len(set(r)) >= 5 for r in refs), "degenerate reference continuations"
    return eng, prompts, refs


def request(i, prompt, eos=(96,), **params):
    params.setdefault("temperature", 0.0)
    return Request(i, None, prompt, SamplingParams(**params), IdTokenizer(), tuple(eos), MAX_SEQ, 0)


def check(req, want):
    ids, text, reason = want
    out = req.output()
    assert (out.token_ids, out.finish_reason) == (ids, reason)
    assert out.text == text


def test_eos_and_stop_token_ids(world):
    eng, prompts, refs = world
    tok = IdTokenizer()
    reqs, wants = [], []
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        eos = ref[6]  # a token the model does generate
        second = ref[12]
        # EOS ends generation, EOS is the last token
        reqs.append(request(len(reqs), p, eos=(eos,), max_tokens=FREE_TOKENS))
        wants.append(brute_force(ref, tok, max_tokens=FREE_TOKENS, stop_ids={eos}))
        # several EOS ids: the first one generated wins
        reqs.append(request(len(reqs), p, eos=(second, eos), max_tokens=FREE_TOKENS))
        wants.append(brute_force(ref, tok, max_tokens=FREE_TOKENS, stop_ids={eos, second}))
        # ignore_eos: straight to max_tokens
        reqs.append(request(len(reqs), p, eos=(eos,), max_tokens=FREE_TOKENS - 2, ignore_eos=True))
        wants.append(brute_force(ref, tok, max_tokens=FREE_TOKENS - 2))
        # stop_token_ids stop even with ignore_eos
        reqs.append(request(len(reqs), p, eos=(ref[0],), stop_token_ids=[second], ignore_eos=True,
                            max_tokens=FREE_TOKENS))
        wants.append(brute_force(ref, tok, max_tokens=FREE_TOKENS, stop_ids={second}))
        # stop id generated exactly at max_tokens -> "stop"
        k = ref.index(eos) + 1
        reqs.append(request(len(reqs), p, eos=(eos,), max_tokens=k))
        wants.append(brute_force(ref, tok, max_tokens=k, stop_ids={eos}))
    eng.run(reqs)
    for r, w in zip(reqs, wants):
        check(r, w)
    assert any(w[2] == "stop" and len(w[0]) > 1 for w in wants)
    assert all(r.output().token_ids[-1] in r.stop_ids for r, w in zip(reqs, wants) if w[2] == "stop")


def stop_string_cases(ref_text: str, rng: random.Random):
    """Stop-string lists built from the unconstrained text: spanning token boundaries, whole tokens,
    a later-listed string that occurs first, one that never occurs."""
    n = len(ref_text)
    cases = []
    for _ in range(4):
        a = rng.randrange(1, n - 6)
        cases.append([ref_text[a: a + rng.randint(2, 6)]])
    first = ref_text.index(">", 10) + 1  # a whole token "<..>" starting after the first few
    whole = ref_text[first: ref_text.index(">", first) + 1]
    cases.append([whole])
    cases.append(["<1000>", ref_text[n // 2: n // 2 + 5], ref_text[n // 4: n // 4 + 3]])
    cases.append(["never there"])
    cases.append([ref_text[:2]])  # inside the first token
    return cases


def test_stop_strings(world):
    eng, prompts, refs = world
    tok = IdTokenizer()
    rng = random.Random(0)
    reqs, wants = [], []
    for p, ref in zip(prompts, refs):
        for stops in stop_string_cases(tok.decode(ref), rng):
            reqs.append(request(len(reqs), p, stop=stops, max_tokens=FREE_TOKENS, ignore_eos=True))
            wants.append(brute_force(ref, tok, max_tokens=FREE_TOKENS, stops=stops))
    eng.run(reqs)
    for r, w in zip(reqs, wants):
        check(r, w)
        out = r.output()
        assert not any(s in out.text for s in r.params.stop)
        if w[2] == "stop":  # generation ended at the token that completed the stop string
            full = tok.decode(out.token_ids)
            assert any(s in full for s in r.params.stop)
            assert not any(s in tok.decode(out.token_ids[:-1]) for s in r.params.stop)
    assert sum(w[2] == "stop" for w in wants) >= len(wants) // 2
    assert any(w[2] == "length" for w in wants)


def test_max_tokens_and_context_limit(world):
    eng, prompts, refs = world
    reqs = [request(i, prompts[i % len(prompts)], max_tokens=n, ignore_eos=True)
            for i, n in enumerate([1, 2, 5, 17])]
    rng = np.random.default_rng(9)
    long_prompt = [int(t) for t in rng.integers(0, 96, MAX_SEQ - 4)]
    reqs.append(request(10, long_prompt, max_tokens=50, ignore_eos=True))  # room for 4 tokens
    reqs.append(request(11, long_prompt, max_tokens=4, ignore_eos=True))
    reqs.append(request(12, long_prompt[:-3] + long_prompt[-1:], max_tokens=50, ignore_eos=True))
    reqs.append(request(13, long_prompt + [1, 2, 3], max_tokens=50, ignore_eos=True))  # room for 1
    eng.run(reqs)
    for r, n in zip(reqs[:4], [1, 2, 5, 17]):
        assert r.token_ids == refs[r.id % len(prompts)][:n]
        assert r.finish_reason == "length" and len(r.token_ids) == n
    assert reqs[4].finish_reason == "length" and len(reqs[4].token_ids) == 4
    assert reqs[4].token_ids == reqs[5].token_ids
    assert len(reqs[6].token_ids) == 6 and reqs[6].finish_reason == "length"
    assert len(reqs[7].token_ids) == 1 and reqs[7].finish_reason == "length"
    assert eng.alloc.num_free == int(eng.state.cache.kv[0].shape[0]) - 1


# ----------------------------------------------------------------- Request alone, randomized

class TableTokenizer:
    """Tokens decode to short strings (some empty), so stop strings straddle tokens in odd ways."""
    TABLE = ["a", "b", "ab", "ba", "abc", "c", "", "cc", "bca", " ", "\n"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.TABLE[i] for i in ids)


@pytest.mark.parametrize("seed", range(4))
def test_request_append_brute_force(seed):
    rng = random.Random(seed)
    tok = TableTokenizer()
    V = len(tok.TABLE)
    for _ in range(400):
        tokens = [rng.randrange(V) for _ in range(rng.randint(1, 40))]
        pool = tok.decode([rng.randrange(V) for _ in range(40)])
        stops = []
        for _ in range(rng.randint(0, 3)):
            a = rng.randrange(max(1, len(pool) - 1))
            s = pool[a: a + rng.randint(1, 6)]
            if s:
                stops.append(s)
        stop_ids = rng.sample(range(V), rng.randint(0, 2))
        eos = (rng.randrange(V),)
        ignore_eos = rng.random() < 0.5
        max_tokens = rng.randint(1, 45)
        prompt = [0] * rng.randint(1, 10)
        max_seq = len(prompt) + rng.randint(1, 50)
        params = SamplingParams(max_tokens=max_tokens, stop=stops, stop_token_ids=stop_ids, ignore_eos=ignore_eos)
        req = Request(0, None, prompt, params, tok, eos, max_seq, 0)
        done_at = None
        for n, t in enumerate(tokens, 1):
            if req.append(t):
                done_at = n
                break
        all_ids = set(stop_ids) | (set() if ignore_eos else set(eos))
        try:
            want = brute_force(tokens, tok, max_tokens=max_tokens, stop_ids=all_ids, stops=stops,
                               room=max_seq - len(prompt))
        except AssertionError:  # the sequence ran out before any stop: still running
            assert done_at is None and not req.finished and req.token_ids == tokens
            continue
        assert done_at == len(want[0]), (tokens, stops, stop_ids, max_tokens)
        assert req.append(5) is True  # appending after the end is a no-op
        check(req, want)
