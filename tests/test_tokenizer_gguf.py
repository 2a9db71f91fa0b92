"""The tokenizer rebuilt from GGUF metadata (specjax.convert.gguf) against transformers' own GGUF loader."""
from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from specjax.checkpoint import load_tokenizer
from specjax.convert import ConvertError
from specjax.convert.gguf import build_tokenizer_files, open_gguf

TEXTS = [
    "Hello world!",
    "  leading and trailing spaces  ",
    "café naïve résumé — “curly quotes” ‘single’ «guillemets»",
    "日本語のテキスト、中文，한국어 and Ελληνικά / русский",
    "emoji 🤖👍🏽 and a ZWJ family 👨‍👩‍👧",
    "def f(x):\n    return x ** 2  # square\n\tindented\twith\ttabs\n",
    "<|im_start|>user\nhello<|im_end|>\n<|endoftext|>",
    "Numbers 3.14159, 1,000,000 and 2024-01-01T12:30:00Z",
    "a\n\n\nb\r\nc \n d",
    "URL: https://example.com/path?q=1&r=2#frag and mail@example.org",
    "I'm sure they'll say we've DONE it, don't you? It's 'quoted'.",
    "",
    "   ",
    "Ġ raw Ġ byte-level symbols ĉ Ċ",
    "<repo_name>specjax<file_sep>main.py<jupyter_code>print(1)",
    '{"key": [1, 2, {"nested": null}], "ok": true}',
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!\nHow are you?"},
     {"role": "assistant", "content": "Fine 🙂"}, {"role": "user", "content": "Write `code`:\n  x = 1"}],
]


@pytest.fixture(scope="module")
def pair():
    """(ours from the converted default model dir, transformers' tokenizer from the same GGUF)."""
    from transformers import AutoTokenizer

    from specjax.default_model import default_gguf_path, ensure_default

    ours = load_tokenizer(ensure_default())
    gguf = default_gguf_path()
    ref = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return ours, ref


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_matches_transformers(pair, text):
    ours, ref = pair
    ids = ours(text).input_ids
    assert ids == ref(text).input_ids
    assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert ours.decode(ids) == ref.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(pair, messages, gen):
    ours, ref = pair
    text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n" if gen else "<|im_end|>\n")
    ids = ours.apply_chat_template(messages, add_generation_prompt=gen)["input_ids"]
    assert ids == ref.apply_chat_template(messages, add_generation_prompt=gen)["input_ids"]
    assert ids[0] == ours.convert_tokens_to_ids("<|im_start|>") == 1


def test_special_tokens(pair):
    ours, ref = pair
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert (ours.bos_token, ours.eos_token, ours.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    assert ours("<jupyter_output>").input_ids == [14]  # control tokens stay whole
    assert len(ours) == len(ref) == 49152


def test_digits_split_like_llama_cpp(pair):
    """tokenizer.ggml.pre = 'smollm': every digit is split off before the GPT-2 regex (llama.cpp and the
    original SmolLM2 tokenizer.json). transformers' GGUF loader skips that step, so whitespace runs in front
    of digits can differ from it ('x  42': ours x|ĠĠ|4|2, transformers x|Ġ|Ġ|4|2)."""
    ours, _ = pair
    assert ours.convert_ids_to_tokens(ours("x  42").input_ids) == ["x", "ĠĠ", "4", "2"]
    assert ours.convert_ids_to_tokens(ours("v1.25").input_ids) == ["v", "1", ".", "2", "5"]


# ---------------------------------------------------------------- synthetic GGUF tokenizers

def byte_alphabet() -> list[str]:
    """GPT-2 byte-level symbols for bytes 0..255: printable latin-1 as itself, the rest shifted past 255."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, shift = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + shift))
            shift += 1
    return out


def write_tok_gguf(path: Path, model: str = "gpt2", pre: str = "llama-bpe", add_bos: bool = True) -> None:
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġa n", "Ġan d", "1 2", "12 3", "Ġ Ġ"]
    tokens = byte_alphabet() + [m.replace(" ", "") for m in merges] + ["<|begin|>", "<|end|>", "<think>"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(8)
    w.add_head_count(2)
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 3) + [3, 3, 4])  # two control tokens, one user-defined
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 3)
    w.add_eos_token_id(len(tokens) - 2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                        "{{ eos_token }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2"])
@pytest.mark.parametrize("add_bos", [True, False])
def test_synthetic_gguf_tokenizer_matches_transformers(tmp_path, pre, add_bos):
    from transformers import AutoTokenizer

    (tmp_path / "src").mkdir()
    (tmp_path / "out").mkdir()
    write_tok_gguf(tmp_path / "src" / "t.gguf", pre=pre, add_bos=add_bos)
    for name, text in build_tokenizer_files(open_gguf(tmp_path / "src" / "t.gguf")).items():
        (tmp_path / "out" / name).write_text(text)
    ours = load_tokenizer(tmp_path / "out")
    ref = AutoTokenizer.from_pretrained(str(tmp_path / "src"), gguf_file="t.gguf")
    for text in ["the and 123 in", "  the  1234<think>x<|end|>", "Hello\n\n world 🤖", "don't THE", ""]:
        ids = ours(text).input_ids
        assert ids == ref(text).input_ids, text
        assert (ids[:1] == [ours.bos_token_id]) == add_bos
        assert ours.decode(ids) == ref.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": "the end"}]
    assert ours.apply_chat_template(chat, tokenize=False) == "<|begin|>user: the end<|end|>"
    assert ours.apply_chat_template(chat)["input_ids"] == ref.apply_chat_template(chat)["input_ids"]


def test_unsupported_tokenizers(tmp_path):
    path = tmp_path / "t.gguf"
    write_tok_gguf(path, model="llama")
    with pytest.raises(ConvertError, match="tokenizer model 'llama' is not supported"):
        build_tokenizer_files(open_gguf(path))
    write_tok_gguf(path, pre="made-up-pre")
    with pytest.raises(ConvertError, match="pre-tokenizer 'made-up-pre' is not supported"):
        build_tokenizer_files(open_gguf(path))
