"""Tokenizers with one interface: `vocab_size`, `eod`, `tokenize(text)`, `detokenize(ids)`.

- `ByteTokenizer`: ids 0–255 are the UTF-8 bytes, 256 is end-of-document. Needs
  no files; the default for demos and tests.
- `GPT2BPETokenizer`: GPT-2's byte-level BPE from `vocab.json` + `merges.txt`
  (`gpt2_bpe`: tiktoken encodes when installed, pure Python otherwise).
- `HuggingFaceTokenizer`: any local tokenizer directory via `transformers`.

`build_tokenizer` picks one by Megatron's `--tokenizer-type` names.
"""

from __future__ import annotations

from typing import Any

from megapp.data.gpt2_bpe import GPT2_EOD, GPT2BPETokenizer

BYTE_TOKENIZER = "ByteTokenizer"
GPT2_BPE_TOKENIZER = "GPT2BPETokenizer"
HUGGINGFACE_TOKENIZER = "HuggingFaceTokenizer"
TOKENIZER_TYPES = (BYTE_TOKENIZER, GPT2_BPE_TOKENIZER, HUGGINGFACE_TOKENIZER)


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
    gpt2_backend: str = "auto",
) -> ByteTokenizer | GPT2BPETokenizer | HuggingFaceTokenizer:
    """The tokenizer named by `tokenizer_type` (one of TOKENIZER_TYPES), built from its files
    (`gpt2_backend`: which encoder GPT2BPETokenizer uses, see `gpt2_bpe`)."""
    if tokenizer_type == BYTE_TOKENIZER:
        return ByteTokenizer()
    if tokenizer_type == GPT2_BPE_TOKENIZER:
        # No files at all: GPT-2's own, from an installed package that ships them.
        return GPT2BPETokenizer(vocab_file, merge_file, gpt2_backend)
    if tokenizer_type == HUGGINGFACE_TOKENIZER:
        if tokenizer_model is None:
            raise ValueError("HuggingFaceTokenizer needs --tokenizer-model (a local directory)")
        return HuggingFaceTokenizer(tokenizer_model)
    raise ValueError(
        f"unknown tokenizer type {tokenizer_type!r}; known: {', '.join(TOKENIZER_TYPES)}"
    )
