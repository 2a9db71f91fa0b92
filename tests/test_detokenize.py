"""Incremental detokenization (specjax.detokenize) and the requests built on it: the text after
every burst of tokens equals the tokenizer's full decode (the default model's byte-level BPE, a
SentencePiece-style byte-fallback tokenizer), stop strings end generation at the same token as a
brute-force search of the full decode, streaming deltas concatenate to the final text, and the
host decodes O(new tokens) per burst."""
from __future__ import annotations

import logging
import random

import pytest

from specjax.detokenize import IncrementalDetokenizer
from specjax.request import Request
from specjax.sampling_params import SamplingParams

MULTIBYTE = "héllo 世界 🎉🚀 naïve Ωmega — “quotes” 👩‍👩‍👧 ß∂ƒ\t\n  spaces  "


@pytest.fixture(scope="module")
def smol_tok():
    from specjax.checkpoint import load_tokenizer
    from specjax.default_model import ensure_default
    return load_tokenizer(ensure_default())


@pytest.fixture(scope="module")
def spm_tok():
    """A Llama-2-style tokenizer: metaspace words, byte fallback for everything else, a decoder that
    strips the leading space of the whole text."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for w in ["▁", "▁a", "▁the", "▁cat", "cat", "s", "▁sat", "▁on", "▁mat", "at", "▁é", "é"]:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)
    assert fast.decode(fast.encode("a cat", add_special_tokens=False)) == "a cat"
    return fast


def random_ids(tok, rng: random.Random, n: int) -> list[int]:
    """Uniform ids, runs of a multi-byte text's tokens (characters split over tokens) and special
    tokens, mixed."""
    text_ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    special = list(tok.all_special_ids)
    out = []
    while len(out) < n:
        r = rng.random()
        if r < 0.4:
            out.append(rng.randrange(len(tok)))
        elif r < 0.85:
            a = rng.randrange(len(text_ids))
            out.extend(text_ids[a: a + rng.randint(1, 8)])
        else:
            out.append(rng.choice(special))
    return out[:n]


def bursts(rng: random.Random, n: int) -> list[int]:
    """Cut points 0 < c1 < ... = n with bursts of 1..9 tokens (an engine step's delivery)."""
    cuts, at = [], 0
    while at < n:
        at = min(n, at + rng.randint(1, 9))
        cuts.append(at)
    return cuts


def full(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("which", ["smol_tok", "spm_tok"])
def test_incremental_text_equals_full_decode(which, request):
    tok = request.getfixturevalue(which)
    rng = random.Random(0)
    for trial in range(60):
        ids: list[int] = []
        d = IncrementalDetokenizer(tok, ids)
        seq = random_ids(tok, rng, rng.randint(1, 120))
        stable_text = ""
        for end in bursts(rng, len(seq)):
            ids.extend(seq[len(ids): end])
            d.update()
            want = full(tok, ids)
            assert len(d) == len(want) and d.suffix(0) == want, (trial, ids)
            assert want.startswith(stable_text)  # text called stable did not change
            stable_text = want[: d.stable]
            assert d.suffix(max(0, len(want) - 5)) == want[-5:]
        assert not d.whole and d.text() == full(tok, seq)


def test_multibyte_characters_wait_for_their_bytes(smol_tok):
    tok = smol_tok
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # the emoji's bytes are split over tokens
    got: list[int] = []
    d = IncrementalDetokenizer(tok, got)
    for i, t in enumerate(ids):
        got.append(t)
        d.update()
        if i < len(ids) - 1:
            assert d.stable == 0 and d.tail.endswith("\ufffd")  # incomplete: nothing committed
    assert d.stable == 1 and d.text() == "🎉"


def brute_force(tokens, tok, *, max_tokens, stop_ids, stops):
    """Token by token over the full decode: (kept tokens, text, finish reason) or None."""
    for n in range(1, len(tokens) + 1):
        out = tokens[:n]
        text = full(tok, out)
        if out[-1] in stop_ids:
            return out, text, "stop"
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return out, text[: min(hits)], "stop"
        if n >= max_tokens:
            return out, text, "length"
    return None


@pytest.mark.parametrize("which", ["smol_tok", "spm_tok"])
def test_stop_strings_in_bursts_match_brute_force(which, request):
    """Bursts of tokens (as engine steps deliver them) end at the same token as the per-token
    full-decode reference; stop strings cross token boundaries and multi-byte characters."""
    tok = request.getfixturevalue(which)
    rng = random.Random(1)
    checked = stopped = 0
    for trial in range(150):
        seq = random_ids(tok, rng, 60)
        text = full(tok, seq)
        stops = []
        for _ in range(rng.randint(1, 3)):
            if len(text) > 3:
                a = rng.randrange(len(text) - 2)
                stops.append(text[a: a + rng.randint(1, 6)])
        stops = [s for s in stops if s] or ["never"]
        stop_ids = set(rng.sample(seq, 1)) if rng.random() < 0.3 else set()
        max_tokens = rng.randint(5, 70)
        params = SamplingParams(max_tokens=max_tokens, stop=stops, stop_token_ids=sorted(stop_ids),
                                ignore_eos=True, logprobs=1)
        req = Request(trial, None, [1], params, tok, (), 4096, 0)
        deltas = []
        for end in bursts(rng, len(seq)):
            chunk = seq[len(req.token_ids): end] if not req.finished else []
            lps = [-float(t) for t in chunk]
            done = req.extend(chunk, lps, [[(t, -1.0)] for t in chunk])
            deltas.append(req.take_text_delta())
            if done:
                break
        assert not req._detok.whole  # incremental all along (no fallback to full decodes)
        want = brute_force(seq, tok, max_tokens=max_tokens, stop_ids=stop_ids, stops=stops)
        if want is None:
            assert not req.finished and req.token_ids == seq
            continue
        out = req.output()
        assert (out.token_ids, out.text, out.finish_reason) == want, (trial, stops, stop_ids, max_tokens)
        assert [list(e) for e in out.logprobs] == [[t] for t in out.token_ids]
        assert out.logprobs[0][out.token_ids[0]] == -float(out.token_ids[0])
        assert "".join(deltas) == out.text
        checked += 1
        stopped += want[2] == "stop" and len(want[1]) < len(full(tok, want[0]))
    assert checked >= 100 and stopped >= 30  # most cases end on a stop string, cut inside the text


def test_streaming_holds_back_incomplete_characters(smol_tok):
    tok = smol_tok
    ids = tok.encode("ab🎉cd", add_special_tokens=False)
    req = Request(0, None, [1], SamplingParams(max_tokens=len(ids), ignore_eos=True), tok, (), 4096, 0)
    deltas = []
    for t in ids:
        req.append(t)
        deltas.append(req.take_text_delta())
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == "ab🎉cd" and req.finish_reason == "length"


class CountingTokenizer:
    """Wraps a tokenizer and counts the token ids it is asked to decode."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_host_work_grows_with_new_tokens_only(smol_tok):
    """Decoding a long output with stop strings and streaming: the ids decoded per delivered token
    stay bounded (the full decode per token did n/2 on average)."""
    tok = CountingTokenizer(smol_tok)
    rng = random.Random(2)
    seq = random_ids(smol_tok, rng, 3000)
    text = full(smol_tok, seq)
    params = SamplingParams(max_tokens=len(seq), stop=["\x00never\x00", "zzzzzzzzzzzz"], ignore_eos=True)
    assert not any(s in text for s in params.stop)
    req = Request(0, None, [1], params, tok, (), 10_000, 0)
    deltas = []
    for end in bursts(rng, len(seq)):
        req.extend(seq[len(req.token_ids): end])
        deltas.append(req.take_text_delta())
    assert req.finish_reason == "length" and "".join(deltas) == text
    during = tok.decoded
    assert during <= 40 * len(seq), during  # windows of <= 16 + 9 tokens; a full decode per token: ~1.5e6
    assert req.output().text == text


def test_non_local_decode_falls_back_to_full_decode(caplog):
    """A decode that rewrites text across tokens (transformers' space clean-up) is seen when it
    changes the window's context: the request decodes whole from then on, still exact, and says so."""

    class CleanUp:
        """Pieces concatenated, then " ." -> "." (like clean_up_tokenization_spaces)."""
        WORDS = ["a ", "b", ".", " c", ",", "dd "]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.WORDS[i] for i in ids).replace(" .", ".").replace(" ,", ",")

    tok = CleanUp()
    ids: list[int] = []
    d = IncrementalDetokenizer(tok, ids)
    with caplog.at_level(logging.WARNING, logger="specjax.detokenize"):
        for t in [1, 3, 0, 2, 5, 4, 0, 2, 1]:
            ids.append(t)
            d.update()
            assert d.suffix(0) == tok.decode(ids)
    assert d.whole and "not local" in caplog.text
