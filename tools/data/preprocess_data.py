"""Tokenize text into Megatron's `.bin`/`.idx` format for training.

    python tools/data/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt --append-eod --workers 4

Inputs are JSON-lines files (`.jsonl`/`.json`: one object per line, text under
`--json-keys`, default `text`) or plain text files (one document per file, or one
per non-empty line with `--one-document-per-line`). Each key gets its own pair
`{output_prefix}_{key}_document.bin/.idx` (plain text uses the key `text`); pass
that prefix to `--data-path`. As in Megatron-LM's tool, a JSON text may be a list of
strings (sentences): each non-empty one becomes a sequence of the document, the EOD
closing the last; a text with no tokens becomes a document with no sequences.
Unreadable, malformed or empty input stops the run with one line naming the file
(and line), exit status 1, and no output left behind.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from megapp.data.gpt2_bpe import BACKENDS
from megapp.data.indexed_dataset import (
    IndexedDatasetBuilder,
    data_file_path,
    index_file_path,
    optimal_dtype,
)
from megapp.data.tokenizers import BYTE_TOKENIZER, TOKENIZER_TYPES, build_tokenizer

JSONL_SUFFIXES = (".jsonl", ".json")
# Documents handed to the pool at a time: bounds memory on inputs of any size.
WINDOW_PER_WORKER = 512


class InputError(Exception):
    """A problem with an input file; the message names the file."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input")
    group.add_argument("--input", nargs="+", required=True, help="input files")
    group.add_argument(
        "--input-format",
        choices=("auto", "jsonl", "text"),
        default="auto",
        help="auto: jsonl for .jsonl/.json files, text otherwise",
    )
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract")
    group.add_argument(
        "--one-document-per-line",
        action="store_true",
        help="plain text: each non-empty line is a document (default: each file)",
    )
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=BYTE_TOKENIZER)
    group.add_argument("--vocab-file", help="GPT-2 vocab.json")
    group.add_argument("--merge-file", help="GPT-2 merges.txt")
    group.add_argument("--tokenizer-model", help="local HuggingFace tokenizer directory")
    group.add_argument("--append-eod", action="store_true", help="end each document with EOD")
    group.add_argument(
        "--tokenizer-backend",
        choices=BACKENDS,
        default="auto",
        help="GPT2BPETokenizer's encoder: tiktoken when installed (auto), or pure Python",
    )
    group = parser.add_argument_group("output")
    group.add_argument("--output-prefix", required=True, help="prefix of the output pairs")
    group.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    group.add_argument(
        "--log-interval", type=float, default=10.0, help="seconds between progress lines"
    )
    args = parser.parse_args(argv)
    if args.workers < 1 or args.log_interval <= 0:
        parser.error("--workers must be at least 1 and --log-interval positive")
    return args


def _is_jsonl(path: str, input_format: str) -> bool:
    if input_format == "auto":
        return path.endswith(JSONL_SUFFIXES)
    return input_format == "jsonl"


Text = str | list[str]


def _is_text(value: Any) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and all(isinstance(v, str) for v in value)
    )


def _jsonl_documents(path: str, keys: list[str]) -> Iterator[tuple[dict[str, Text], int]]:
    with open(path, encoding="utf-8") as stream:
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(f"{path}:{number}: malformed JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise InputError(f"{path}:{number}: expected a JSON object")
            for key in keys:
                if not _is_text(record.get(key)):
                    problem = "missing" if key not in record else "not a string or strings"
                    raise InputError(f"{path}:{number}: key {key!r} is {problem}")
            yield {key: record[key] for key in keys}, len(line.encode("utf-8"))


def _text_documents(path: str, per_line: bool) -> Iterator[tuple[dict[str, Text], int]]:
    with open(path, encoding="utf-8") as stream:
        if not per_line:
            text = stream.read()
            if text.strip():
                yield {"text": text}, len(text.encode("utf-8"))
            return
        for line in stream:
            if line.strip():
                yield {"text": line.rstrip("\n")}, len(line.encode("utf-8"))


def read_documents(args: argparse.Namespace) -> Iterator[tuple[dict[str, Text], int]]:
    """Every document of every input, as ({key: text}, input bytes it took); raises
    InputError naming the file."""
    for path in args.input:
        count = 0
        try:
            if _is_jsonl(path, args.input_format):
                documents = _jsonl_documents(path, args.json_keys)
            else:
                documents = _text_documents(path, args.one_document_per_line)
            for document in documents:
                count += 1
                yield document
        except UnicodeDecodeError as error:
            raise InputError(
                f"{path}: not UTF-8 text ({error.reason} at byte {error.start})"
            ) from None
        except OSError as error:
            raise InputError(f"{path}: cannot read ({error.strerror or error})") from None
        if count == 0:
            raise InputError(f"{path}: no documents (the input is empty)")


class _Guarded:
    """Wraps the document reader so an input error ends the stream and is kept for later,
    instead of surfacing inside a pool worker."""

    def __init__(self, documents: Iterator[tuple[dict[str, Text], int]]) -> None:
        self.documents = documents
        self.error: InputError | None = None

    def __iter__(self) -> Iterator[tuple[dict[str, Text], int]]:
        try:
            yield from self.documents
        except InputError as error:
            self.error = error


_tokenizer: Any = None
_append_eod = False


def _init_worker(tokenizer_args: dict[str, Any], append_eod: bool) -> None:
    global _tokenizer, _append_eod
    _tokenizer = build_tokenizer(**tokenizer_args)
    _append_eod = append_eod


def _encode(item: tuple[dict[str, Text], int]) -> tuple[dict[str, tuple[list, list]], int]:
    """Per key, the document's token ids and its sequence lengths (one per non-empty
    sentence; EOD, if asked, ends the last), and the input bytes it took."""
    document, size = item
    encoded = {}
    for key, text in document.items():
        ids, lengths = [], []
        for sentence in [text] if isinstance(text, str) else text:
            sentence_ids = _tokenizer.tokenize(sentence)
            if sentence_ids:
                ids += sentence_ids
                lengths.append(len(sentence_ids))
        if _append_eod and ids:
            ids.append(_tokenizer.eod)
            lengths[-1] += 1
        encoded[key] = (ids, lengths)
    return encoded, size


def _encoded_stream(
    args: argparse.Namespace, documents: _Guarded, tokenizer_args: dict
) -> Iterator:
    if args.workers == 1:
        _init_worker(tokenizer_args, args.append_eod)
        yield from map(_encode, documents)
        return
    stream = iter(documents)
    with multiprocessing.Pool(
        args.workers, _init_worker, (tokenizer_args, args.append_eod)
    ) as pool:
        while window := list(itertools.islice(stream, WINDOW_PER_WORKER * args.workers)):
            yield from pool.imap(_encode, window, chunksize=16)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer_args = dict(
        tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        gpt2_backend=args.tokenizer_backend,
    )
    try:
        tokenizer = build_tokenizer(**tokenizer_args)
    except (OSError, ValueError, ImportError) as error:
        print(f"error: tokenizer: {error}", file=sys.stderr)
        return 1
    kinds = {_is_jsonl(p, args.input_format) for p in args.input}
    if len(kinds) > 1:
        print("error: --input mixes JSON-lines and plain text files", file=sys.stderr)
        return 1
    keys = args.json_keys if kinds == {True} else ["text"]
    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in keys}
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    dtype = optimal_dtype(tokenizer.vocab_size)
    builders = {key: IndexedDatasetBuilder(data_file_path(p), dtype) for key, p in prefixes.items()}
    documents = _Guarded(read_documents(args))
    try:
        count, tokens, seconds = _write(args, documents, tokenizer_args, builders)
    except ValueError as error:  # a tokenizer failing on some text, or ids beyond the dtype
        documents.error = InputError(f"tokenizing {', '.join(args.input)}: {error}")
    for key, builder in builders.items():
        builder.finalize(index_file_path(prefixes[key]))
    if documents.error is not None:
        for prefix in prefixes.values():
            for path in (data_file_path(prefix), index_file_path(prefix)):
                if os.path.exists(path):
                    os.remove(path)
        print(f"error: {documents.error}", file=sys.stderr)
        return 1
    print(
        f"done: {count} documents, {tokens} tokens in {seconds:.1f} s "
        f"({tokens / max(seconds, 1e-9):,.0f} tokens/s, {_describe(tokenizer)}) -> "
        + ", ".join(f"{p}.bin/.idx" for p in prefixes.values()),
        file=sys.stderr,
    )
    return 0


def _describe(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend", None)
    name = type(tokenizer).__name__
    return f"{name}, {backend} encoder" if backend else name


class Progress:
    """Progress lines every `interval` seconds: documents, tokens/s, input read, ETA."""

    def __init__(self, total_bytes: int, interval: float) -> None:
        self.total_bytes, self.interval = max(total_bytes, 1), interval
        self.start = self.last = time.time()

    def maybe_print(self, documents: int, tokens: int, read_bytes: int) -> None:
        now = time.time()
        if now - self.last < self.interval:
            return
        self.last = now
        elapsed = now - self.start
        done = min(read_bytes / self.total_bytes, 1.0)
        eta = elapsed * (1 - done) / done if done > 0 else float("inf")
        print(
            f"processed {documents} documents, {tokens} tokens ({tokens / elapsed:,.0f} "
            f"tokens/s, {read_bytes / elapsed / 1e6:.2f} MB/s); {100 * done:.1f}% of the "
            f"input, ETA {_duration(eta)}",
            file=sys.stderr,
            flush=True,
        )


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "unknown"
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


def _write(
    args: argparse.Namespace,
    documents: _Guarded,
    tokenizer_args: dict[str, Any],
    builders: dict[str, IndexedDatasetBuilder],
) -> tuple[int, int, float]:
    """Tokenize every document into the builders; returns documents, tokens and seconds."""
    total = sum(os.path.getsize(p) for p in args.input if os.path.isfile(p))
    progress = Progress(total, args.log_interval)
    count, size, tokens = 0, 0, 0
    for encoded, nbytes in _encoded_stream(args, documents, tokenizer_args):
        for key, (ids, lengths) in encoded.items():
            builders[key].add_document(ids, lengths)
            tokens += len(ids)
        count, size = count + 1, size + nbytes
        progress.maybe_print(count, tokens, size)
    return count, tokens, time.time() - progress.start


if __name__ == "__main__":
    sys.exit(main())
