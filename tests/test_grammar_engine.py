"""Grammar-constrained decoding through the engine, on a tiny random model whose 97 tokens are
characters (so xgrammar works on them without a real tokenizer): plain decoding matches a
brute-force reference (dense forward + a fresh matcher per step); plain (forward | sample with the
masks computed meanwhile, or masks first), chain and tree speculation, async or sync loop, overlap
on or off all give the same tokens; constrained and unconstrained rows mix in a batch (the
unconstrained ones give what they give alone); a bad constraint, or a grammar whose matcher breaks
mid-way (in the masks or in accepting tokens), fails only its request; preemption keeps the grammar
state."""
from __future__ import annotations

import dataclasses
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

from grammar_faults import BrokenMatcher
from helpers import tiny_config, tiny_model
from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.grammar import GrammarCompiler, RequestGrammar
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.scheduler import SchedulerOptions
from specjax.tree import SpecConfig

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

MAX_SEQ = 96
EOS = 96
CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ{}[]\":,. -_+*/\\'()!?;=<>@#$%&|~^`"
VOCAB = list(CHARS) + ["ab", ""]  # 97 tokens; the last one (EOS) decodes to nothing
assert len(VOCAB) == 97

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                   "kind": {"enum": ["cat", "dog"]},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
                   "pos": {"type": "object", "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5}},
                           "required": ["x"], "additionalProperties": False}},
    "required": ["id", "kind", "tags", "pos"],
    "additionalProperties": False,
}
EBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "x" [0-9]'
CONSTRAINTS = [dict(json_schema=SCHEMA), dict(regex=r"[a-f]{2,5}(-[0-9]{1,3})?"), dict(choice=["red", "green", "blue"]),
               dict(grammar=EBNF), {}, dict(json_schema={"type": "array", "items": {"type": "boolean"}, "maxItems": 3}),
               dict(regex=r"(yes|no)!"), {}]


class CharTokenizer:
    eos_token_id = EOS
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [VOCAB.index(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(VOCAB[i] for i in ids)


@pytest.fixture(scope="module")
def world():
    cfg = tiny_config(vocab_size=97, eos_token_id=EOS)
    target = tiny_model(cfg, seed=2)
    dcfg = tiny_config(num_hidden_layers=1)
    other = tiny_model(dcfg, seed=6)
    info = xgrammar.TokenizerInfo(VOCAB, vocab_size=97, stop_token_ids=[EOS])
    compiler = GrammarCompiler(info, 97)
    rng = np.random.default_rng(4)
    prompts = [CharTokenizer().encode("".join(rng.choice(list(CHARS[:62]), size=int(n))))
               for n in rng.integers(3, 20, 8)]
    return cfg, target, dcfg, other, compiler, prompts, {}


def make_engine(world, draft=None, *, sched=SchedulerOptions()):
    """One engine per draft configuration, shared by the tests (same programs); sched is set per use."""
    cfg, target, dcfg, other, compiler, _, cache = world
    if draft in cache:
        cache[draft].opts = sched
        return cache[draft]
    d = None
    if draft is not None:
        which, k, topk, m, *branch = draft  # branch: SpecConfig.ngram_branch (n-gram nodes added)
        if which == "eagle3":  # a random EAGLE-3 head (own 64-token vocabulary, target features)
            from test_spec_eagle import random_head
            head, ecfg = random_head(cfg, "eagle3", draft_vocab=64, aux_layers=(0, 1, 1))
            d = Draft(head, ecfg.layer, DraftInfo("eagle3", ecfg.aux_layers),
                      SpecConfig(method="eagle3", num_steps=k, topk=topk, num_draft_tokens=m,
                                 ngram_branch=sum(branch)))
        else:
            model, mcfg = (target, cfg) if which == "self" else (other, dcfg)
            d = Draft(model, mcfg, DraftInfo("draft"), SpecConfig(method="draft", num_steps=k, topk=topk,
                                                                  num_draft_tokens=m))
    cache[draft] = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ),
                          BatchOptions(max_batch=4, steps_per_call=4), jnp.float32, draft=d, sched=sched,
                          grammar=compiler)
    return cache[draft]


def run(eng, prompts, constraints, max_tokens=60, **kw):
    reqs = [Request(i, None, p, SamplingParams(max_tokens=max_tokens, temperature=0.0, **c, **kw), CharTokenizer(),
                    (EOS,), MAX_SEQ, 0) for i, (p, c) in enumerate(zip(prompts, constraints))]
    eng.run(reqs)
    assert all(s is None for s in eng.slots) and eng.alloc.num_free == int(eng.state.cache.kv[0].shape[0]) - 1
    return [r.output() for r in reqs]


def check_valid(out, constraint):
    """A finished ("stop") output satisfies its constraint."""
    if out.finish_reason != "stop" or not constraint:
        return False
    text = out.text
    if "json_schema" in constraint:
        jsonschema.validate(json.loads(text), constraint["json_schema"])
    elif "regex" in constraint:
        assert re.fullmatch(constraint["regex"], text), text
    elif "choice" in constraint:
        assert text in constraint["choice"]
    else:
        assert re.fullmatch(r"\(([a-c]|x[0-9])(,([a-c]|x[0-9]))*\)", text), text
    assert out.token_ids[-1] == EOS
    return True


@pytest.fixture(scope="module")
def reference(world):
    """Plain constrained greedy decoding through the synchronous loop."""
    prompts = world[5]
    return run(make_engine(world, sched=SchedulerOptions(async_loop=False)), prompts, CONSTRAINTS)


def test_plain_constrained_matches_brute_force(world, reference):
    from test_engine import make_dense
    from specjax.models.llama import flat_state

    cfg, target, _, _, compiler, prompts, _ = world
    dense = make_dense(cfg, flat_state(target))
    for i in (0, 1, 2, 3, 6):
        key = SamplingParams(**CONSTRAINTS[i]).constraint
        m = compiler.matcher(key, [EOS])
        seq, out = list(prompts[i]), []
        while len(out) < 60:
            toks = np.zeros((1, MAX_SEQ + 64), np.int32)
            toks[0, : len(seq)] = seq
            logits = np.asarray(dense(jnp.asarray(toks)))[0, len(seq) - 1]
            allowed = np.unpackbits(m.next_mask().view(np.uint8), bitorder="little")[:97].astype(bool)
            t = int(np.argmax(np.where(allowed, logits, -np.inf)))
            m.accept([t])
            out.append(t)
            seq.append(t)
            if t == EOS:
                break
        assert reference[i].token_ids == out, i
    valid = [check_valid(o, c) for o, c in zip(reference, CONSTRAINTS)]
    assert sum(valid) >= 4, [(o.text, o.finish_reason) for o in reference]
    assert reference[4].finish_reason == "length"  # unconstrained rows run beside the constrained ones


@pytest.mark.parametrize("draft,sched", [
    (None, SchedulerOptions()),
    (None, SchedulerOptions(overlap=False)),
    (("self", 3, 1, None), SchedulerOptions()),
    (("other", 3, 2, 5), SchedulerOptions()),
    (("other", 3, 2, 5), SchedulerOptions(overlap=False)),
    (("self", 2, 2, 4), SchedulerOptions(async_loop=False, overlap=False)),
    (("eagle3", 3, 2, 5), SchedulerOptions()),
    (("eagle3", 3, 2, 5, 3), SchedulerOptions()),
], ids=["plain-async", "plain-no-overlap", "chain-self", "tree-overlap", "tree-no-overlap", "tree-self-sync", "eagle3-tree",
        "eagle3-tree-ngram-branch"])
def test_speculation_and_loops_agree(world, reference, draft, sched):
    outs = run(make_engine(world, draft, sched=sched), world[5], CONSTRAINTS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in reference]
    if draft is not None and draft[0] == "self":  # unconstrained rows accept every drafted token
        assert outs[4].accept_len_mean == draft[1] + 1


def test_bad_constraint_fails_only_its_request(world, reference):
    prompts = world[5]
    bad = [dict(regex="(ab"), dict(json_schema={"type": "bogus"}), dict(grammar="root ::= nothing_here")]
    constraints = bad + CONSTRAINTS[:3]
    outs = run(make_engine(world, ("other", 3, 2, 5)), prompts[5:8] + prompts[:3], constraints)
    for o, words in zip(outs[:3], (["regex", "(ab"], ["json_schema", "bogus"], ["grammar", "nothing_here"])):
        assert o.finish_reason == "error" and o.token_ids == []
        assert all(w in o.error for w in words), o.error
    assert [o.token_ids for o in outs[3:]] == [o.token_ids for o in reference[:3]]
    assert all(o.error is None for o in outs[3:])


def test_grammar_end_finishes_the_request(world):
    """ignore_eos does not keep a finished grammar going: the request stops at its stop token."""
    outs = run(make_engine(world), world[5][:3], [dict(choice=["ab", "abc"]), dict(regex="x{3}"), {}], ignore_eos=True,
               max_tokens=20)
    assert outs[0].text in ("ab", "abc") and outs[0].finish_reason == "stop"
    assert outs[1].text == "xxx" and outs[1].finish_reason == "stop" and outs[1].token_ids[-1] == EOS
    assert outs[2].finish_reason == "length"


@pytest.mark.parametrize("draft", [None, ("other", 3, 2, 5)], ids=["plain", "tree"])
def test_preemption_keeps_grammar_state(world, reference, draft):
    """The scheduler may use 39 pages of 4 tokens only: requests are retracted and recomputed with
    their matchers where they were; the tokens do not change."""
    eng = make_engine(world, draft)
    alloc, before = eng.alloc, eng.num_preempted
    alloc.evict_all()  # the prefix cache forgets its pages: all are on the free list
    kept, alloc.free = alloc.free[:-39], alloc.free[-39:]
    try:
        reqs = [Request(i, None, p, SamplingParams(max_tokens=60, temperature=0.0, **c), CharTokenizer(), (EOS,),
                        MAX_SEQ, 0) for i, (p, c) in enumerate(zip(world[5], CONSTRAINTS))]
        eng.run(reqs)
        assert len(alloc.unused_pages()) == 39 and not any(alloc.owned)
    finally:
        alloc.free = kept + alloc.free
    assert eng.num_preempted > before
    assert [r.token_ids for r in reqs] == [o.token_ids for o in reference]


FORCED = r"KEY-fixed-text-then-more-fixed-text;[\s\S]*"  # a long fixed run, then anything
CHOICE = ["xabcd-first", "xabce-second", "yz"]  # "ab" is a token too: after x, "ab" is likely, not certain


@pytest.mark.parametrize("draft,sched", [
    (("self", 3, 1, None), SchedulerOptions()),
    (("self", 2, 2, 4), SchedulerOptions(async_loop=False, overlap=False)),
], ids=["chain-overlap", "tree-no-overlap"])
def test_grammar_drafts_are_accepted(world, draft, sched):
    """Grammar drafts (specjax.grammar_drafts), the target as its own draft: where the grammar fixes
    the text its drafts are certain; in the permissive tail the draft (the target) continues from them,
    so with consistent draft KV every step of the FORCED row accepts num_steps + 1 tokens. The tokens
    are those of plain constrained decoding, with grammar drafts on and off; off, the fixed text is
    rejected draft by draft: fewer tokens per step (measured) for the fixed text, the choice and JSON.
    The host grammar path (device_dfa=False): device DFAs draft under their masks instead
    (tests/test_device_dfa.py)."""
    sched = dataclasses.replace(sched, device_dfa=False)
    prompts = world[5][:3]
    constraints = [dict(regex=FORCED), dict(choice=CHOICE), dict(json_schema=SCHEMA)]
    plain = run(make_engine(world, sched=SchedulerOptions(device_dfa=False)), prompts, constraints, max_tokens=40)
    eng = make_engine(world, draft, sched=sched)
    on = run(eng, prompts, constraints, max_tokens=40)
    eng.opts = dataclasses.replace(sched, grammar_drafts=False)
    off = run(eng, prompts, constraints, max_tokens=40)
    assert [o.token_ids for o in on] == [o.token_ids for o in plain] == [o.token_ids for o in off]
    assert on[0].accept_len_mean == draft[1] + 1
    on_tau, off_tau = [o.accept_len_mean for o in on], [o.accept_len_mean for o in off]
    assert on_tau[0] >= off_tau[0] + 1.0 and all(a > b for a, b in zip(on_tau, off_tau)), (on_tau, off_tau)


class FaultyGrammar(RequestGrammar):
    """A request's grammar whose matcher breaks after `after` accepted tokens: from then on the
    calls named in `fail` raise (mask filling / tree traversal, or accepting tokens)."""

    def __init__(self, compiled, after: int, fail: tuple[str, ...]):
        super().__init__(compiled, [EOS])
        self.after, self.fail = after, fail

    def advance(self, tokens):
        out = super().advance(tokens)
        if self.num_accepted >= self.after and not isinstance(self._matcher, BrokenMatcher):
            self._matcher = BrokenMatcher(self._matcher, self.fail)
        return out


@pytest.mark.parametrize("draft,sched", [
    (None, SchedulerOptions()),
    (None, SchedulerOptions(overlap=False)),
    (("other", 3, 2, 5), SchedulerOptions()),
], ids=["plain-overlap", "plain-no-overlap", "tree-overlap"])
def test_grammar_fault_fails_only_its_request(world, reference, draft, sched):
    """Request 0 (JSON schema) breaks while its masks are computed, request 3 (EBNF) while accepting
    tokens: both fail with the reason, after some tokens; the others give the reference tokens; no
    slot or page is left behind (run checks); the host phases were timed."""
    eng = make_engine(world, draft, sched=sched)
    compiler, prompts = world[4], world[5]
    before = eng.stats()
    reqs = [Request(i, None, p, SamplingParams(max_tokens=60, temperature=0.0, **c), CharTokenizer(), (EOS,),
                    MAX_SEQ, 0) for i, (p, c) in enumerate(zip(prompts, CONSTRAINTS))]
    fill = ("fill_next_token_bitmask", "traverse_draft_tree")
    reqs[0].grammar = FaultyGrammar(compiler.compile(reqs[0].params.constraint), 4, fill)
    reqs[3].grammar = FaultyGrammar(compiler.compile(reqs[3].params.constraint), 3, ("accept_token",))
    eng.run(reqs)
    assert all(s is None for s in eng.slots) and eng.alloc.num_free == int(eng.state.cache.kv[0].shape[0]) - 1
    for i, phase in ((0, "fill_next_token_bitmask" if draft is None else "traverse_draft_tree"), (3, "accept_token")):
        o = reqs[i].output()
        assert o.finish_reason == "error" and f"injected matcher fault in {phase}" in o.error, (i, o.error)
        assert o.token_ids == reference[i].token_ids[: len(o.token_ids)] and len(o.token_ids) >= 3
    for i in (1, 2, 4, 5, 6, 7):
        o = reqs[i].output()
        assert o.token_ids == reference[i].token_ids and o.error is None, i
    after = eng.stats()
    for phase in ("read", "accept", "masks", "dispatch", "step"):
        assert after[f"host_{phase}_s"] > before[f"host_{phase}_s"], phase
    assert after["host_steps"] > before["host_steps"]


def test_unconstrained_rows_as_alone(world, reference):
    """The unconstrained rows of the constrained batch (one token per step there) give the tokens
    they give in a batch without grammars (steps_per_call tokens per dispatch)."""
    outs = run(make_engine(world), [world[5][4], world[5][7]], [{}, {}])
    assert [o.token_ids for o in outs] == [reference[4].token_ids, reference[7].token_ids]
