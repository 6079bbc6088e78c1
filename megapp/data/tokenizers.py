"""Tokenizers with one interface: `vocab_size`, `eod`, `tokenize(text)`, `detokenize(ids)`.

- `ByteTokenizer`: ids 0–255 are the UTF-8 bytes, 256 is end-of-document. Needs
  no files; the default for demos and tests.
- `GPT2BPETokenizer`: GPT-2's byte-level BPE from `vocab.json` + `merges.txt`,
  implemented here (no extra dependency).
- `HuggingFaceTokenizer`: any local tokenizer directory via `transformers`.

`build_tokenizer` picks one by Megatron's `--tokenizer-type` names.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

BYTE_TOKENIZER = "ByteTokenizer"
GPT2_BPE_TOKENIZER = "GPT2BPETokenizer"
HUGGINGFACE_TOKENIZER = "HuggingFaceTokenizer"
TOKENIZER_TYPES = (BYTE_TOKENIZER, GPT2_BPE_TOKENIZER, HUGGINGFACE_TOKENIZER)
GPT2_EOD = "<|endoftext|>"


class ByteTokenizer:
    """UTF-8 bytes as ids 0–255 plus end-of-document 256; vocab_size 257."""

    def __init__(self) -> None:
        self.vocab_size = 257
        self.eod = 256

    def tokenize(self, text: str) -> list[int]:
        """`text`'s UTF-8 bytes."""
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Any) -> str:
        """Bytes back to text; EOD reads as `<|endoftext|>`, invalid UTF-8 as U+FFFD."""
        pieces, run = [], bytearray()
        for i in (int(t) for t in ids):
            if 0 <= i < 256:
                run.append(i)
            elif i == self.eod:
                pieces += [run.decode("utf-8", errors="replace"), GPT2_EOD]
                run = bytearray()
            else:
                raise ValueError(f"id {i} is outside the byte vocabulary [0, {self.vocab_size})")
        pieces.append(run.decode("utf-8", errors="replace"))
        return "".join(pieces)


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


# GPT-2's pre-tokenizer: contractions, then runs of letters, of digits, or of other
# symbols (each with one optional leading space), then whitespace. Python's `re`
# has no \p{L}: `[^\W\d_]` (word characters that are neither digits nor `_`) stands
# for letters, `\d` for numbers, and `(?:[^\s\w]|_)` for the remaining symbols.
GPT2_PATTERN = re.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""
)


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE.

    Args:
        vocab_file: JSON object mapping token strings (in the bytes_to_unicode alphabet)
            to ids; must contain `<|endoftext|>`, which is the EOD.
        merge_file: one merge "a b" per line in priority order; a first line starting
            with `#version` is skipped.
    """

    def __init__(self, vocab_file: str, merge_file: str) -> None:
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
        """Ids of `text`: pre-tokenize, map bytes to the alphabet, merge, look up."""
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


class HuggingFaceTokenizer:
    """A `transformers` tokenizer loaded from a local directory (no download).

    The EOD is the tokenizer's EOS token; `tokenize` adds no special tokens (the
    preprocessing appends EOD itself).
    """

    def __init__(self, tokenizer_model: str) -> None:
        try:
            import transformers
        except ImportError:
            raise ImportError(
                "HuggingFaceTokenizer needs the `transformers` package: pip install "
                "transformers, or use --tokenizer-type ByteTokenizer or GPT2BPETokenizer"
            ) from None
        self._tokenizer = transformers.AutoTokenizer.from_pretrained(
            tokenizer_model, local_files_only=True
        )
        self.vocab_size = len(self._tokenizer)
        eod = self._tokenizer.eos_token_id
        if eod is None:
            raise ValueError(f"{tokenizer_model}: the tokenizer has no EOS token to use as EOD")
        self.eod = int(eod)

    def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def detokenize(self, ids: Any) -> str:
        return self._tokenizer.decode([int(i) for i in ids])


def build_tokenizer(
    tokenizer_type: str = BYTE_TOKENIZER,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
) -> ByteTokenizer | GPT2BPETokenizer | HuggingFaceTokenizer:
    """The tokenizer named by `tokenizer_type` (one of TOKENIZER_TYPES), built from its files."""
    if tokenizer_type == BYTE_TOKENIZER:
        return ByteTokenizer()
    if tokenizer_type == GPT2_BPE_TOKENIZER:
        if vocab_file is None or merge_file is None:
            raise ValueError("GPT2BPETokenizer needs --vocab-file and --merge-file")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == HUGGINGFACE_TOKENIZER:
        if tokenizer_model is None:
            raise ValueError("HuggingFaceTokenizer needs --tokenizer-model (a local directory)")
        return HuggingFaceTokenizer(tokenizer_model)
    raise ValueError(
        f"unknown tokenizer type {tokenizer_type!r}; known: {', '.join(TOKENIZER_TYPES)}"
    )
