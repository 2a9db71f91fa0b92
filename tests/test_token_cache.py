"""specjax.token_cache.PromptEncoder: the same ids as tokenizer.encode(text, add_special_tokens=False)
on the segment-cache path (cold and warm) and on the plain path; the cache's bound."""
from __future__ import annotations

import random

import pytest
from helpers import IdTokenizer, default_model_or_skip

from specjax.token_cache import PromptEncoder

SMOL_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<reponame>", "<file_sep>"]
# fragments around the added tokens: near misses, whitespace, digits, unicode, a chat header
FRAGMENTS = ["<|im_start", "im_end|>", "<|im_end |>", "<|IM_END|>", "<", "|>", "<|", "<<", ">>", "<repo_nam",
             " ", "  ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "system\n", "user\n", "assistant\n", "Hello",
             " world", "12345", "3.14", "é", "e\u0301", "中文", "🙂", "\u200b", "'s", " don't", "x" * 80]


def plain(tok, text):
    return tok.encode(text, add_special_tokens=False)


def adversarial(specials):
    a, b = specials[0], specials[1]
    return ["", a, a + a + b, f" {a} ", f"\n{b}\n", f"{a}system\nYou are helpful.{b}\n{a}user\nhi{b}\n{a}assistant\n",
            f"<{a}>", f"<|{a}|>", f"{a[:-1]}{a}", f"{a}{b[1:]}", f"x{a}y{b}z", "   " + a + "\t\t" + b + "  ",
            f"{a}é{b}🙂{a}", f"{a}12{b}34", a.replace("|", "| "), f"{a}{a}{a}\n\n{b}{b}", "just text, no tokens"]


def random_texts(specials, n, seed=0):
    rng = random.Random(seed)
    pool = FRAGMENTS + specials * 3
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 30))) for _ in range(n)]


def check_same(tok, texts, **kw):
    """Each text cold (a fresh encoder) and warm (again, and all again on one shared encoder)."""
    shared = PromptEncoder(tok, **kw)
    for text in texts:
        want = plain(tok, text)
        assert PromptEncoder(tok, **kw).encode(text) == want, text
        assert shared.encode(text) == want, text
        assert shared.encode(text) == want, text
    for text in texts:
        assert shared.encode(text) == plain(tok, text), text
    return shared


@pytest.fixture(scope="module")
def smol():
    from specjax.checkpoint import load_tokenizer
    return load_tokenizer(default_model_or_skip())


def test_smollm2_takes_the_cached_path(smol):
    enc = PromptEncoder(smol)
    assert enc.cached, enc.info


@pytest.mark.parametrize("min_chars", [0, 64])
def test_smollm2_same_ids_adversarial_and_random(smol, min_chars):
    texts = adversarial(SMOL_SPECIALS) + random_texts(SMOL_SPECIALS, 150)
    enc = check_same(smol, texts, min_chars=min_chars)
    assert enc.hits > 0


def test_smollm2_chat_prompt_shared_system_prompt(smol):
    system = " ".join(random.Random(1).choice(FRAGMENTS[16:]) for _ in range(600))
    enc = PromptEncoder(smol)
    for q in ["What is 2+2?", "Tell me a story <|im_end|> please", ""]:
        text = smol.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                        tokenize=False, add_generation_prompt=True)
        assert enc.encode(text) == plain(smol, text)
    assert enc.hits >= 2  # the system segment, once per later request


def tiny_fast_tokenizer(added, lstrip=False, pre="bytelevel"):
    """A small trained BPE in a transformers fast tokenizer, with `added` as added special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if pre == "bytelevel"
                         else pre_tokenizers.Metaspace(prepend_scheme=pre))
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(FRAGMENTS)] * 3 + ["the quick brown fox jumps over the lazy dog 0123456789"] * 5
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens([AddedToken(t, lstrip=lstrip, normalized=False) for t in added])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


# one added token a prefix of another, two overlapping ("<x>y" / "y<z>"): leftmost-longest decides
OVERLAP = ["<x>", "<x>y", "y<z>", "<z>", "[end]"]


def test_overlapping_added_tokens_split_like_tokenizers():
    tok = tiny_fast_tokenizer(OVERLAP)
    assert PromptEncoder(tok).cached
    texts = adversarial(OVERLAP) + ["<x>y<z>", "<x>yy<z>", "<x<x>y>", "y<z><x>y<z>"] + random_texts(OVERLAP, 100)
    check_same(tok, texts, min_chars=0)


@pytest.mark.parametrize("kind", ["lstrip", "metaspace_first", "no_fast_tokenizer"])
def test_tokenizers_that_do_not_qualify_take_the_plain_path(kind):
    if kind == "no_fast_tokenizer":
        enc = PromptEncoder(IdTokenizer())
        assert not enc.cached and "not a HF fast tokenizer" in enc.info
        assert enc.encode("<3> <5>") == [3, 5]
        return
    tok = tiny_fast_tokenizer(OVERLAP, lstrip=kind == "lstrip", pre="bytelevel" if kind == "lstrip" else "first")
    enc = PromptEncoder(tok)
    assert not enc.cached and enc.info.startswith("plain"), enc.info
    assert ("lstrip" if kind == "lstrip" else "Metaspace") in enc.info
    for text in adversarial(OVERLAP) + random_texts(OVERLAP, 30):
        assert enc.encode(text) == plain(tok, text), text
    assert enc.cache_chars() == 0 and enc.hits == enc.misses == 0


def test_truncation_left_in_the_backend_falls_back_to_plain():
    tok = tiny_fast_tokenizer(OVERLAP)
    enc = PromptEncoder(tok)
    text = "<x>" + "the quick brown fox " * 20 + "[end]"
    tok._tokenizer.enable_truncation(5)  # as a caller of tokenizer(..., truncation=True) leaves it
    assert enc.encode(text) == plain(tok, text) and len(enc.encode(text)) > 5


def test_cache_bound_and_lru_order():
    tok = tiny_fast_tokenizer(OVERLAP)
    enc = PromptEncoder(tok, max_chars=300, min_chars=10)
    rng = random.Random(2)
    for text in random_texts(OVERLAP, 200, seed=3) + ["the quick brown fox " * 20]:  # a piece > max_chars
        assert enc.encode(text) == plain(tok, text)
        assert enc.cache_chars() == sum(map(len, enc._cache)) <= 300
        assert all(len(k) >= 10 for k in enc._cache)
    enc._cache.clear()
    enc._chars = 0
    a, b, c = ("".join(rng.choice("abcdef ") for _ in range(120)) for _ in range(3))
    for t in (a, b, a, c):  # a used again after b: c evicts b, the least recently used
        enc.encode(f"<x>{t}[end]")
    assert list(enc._cache) == [a, c]


class _Spy:
    """Delegates to a Rust tokenizer, recording which encode entry point the encoder calls."""
    def __init__(self, rust):
        self.rust, self.calls = rust, []

    def __getattr__(self, name):
        if name in ("encode", "encode_batch"):
            self.calls.append(name)
        return getattr(self.rust, name)


def test_uncached_pieces_go_through_encode_batch_in_one_call(smol):
    """Misses are encoded with one encode_batch call (which releases the GIL: the server's engine
    thread keeps dispatching while a long prompt is tokenized), never with encode (which holds it)."""
    enc = PromptEncoder(smol, min_chars=0)
    enc._rust = spy = _Spy(enc._rust)
    text = "<|im_start|>system\nA long system prompt here.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n"
    assert enc.encode(text) == plain(smol, text)
    assert spy.calls.count("encode_batch") == 1 and "encode" not in spy.calls
    spy.calls.clear()
    assert enc.encode(text) == plain(smol, text)  # every piece cached now: no call at all
    assert not [c for c in spy.calls if c.startswith("encode")]
