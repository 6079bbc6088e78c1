"""Tokenize text into Megatron's `.bin`/`.idx` format for training.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt --append-eod --workers 4

Inputs are JSON-lines files (`.jsonl`/`.json`: one object per line, text under
`--json-keys`, default `text`) or plain text files (one document per file, or one
per non-empty line with `--one-document-per-line`). Each key gets its own pair
`{output_prefix}_{key}_document.bin/.idx` (plain text uses the key `text`); pass
that prefix to `--data-path`. Unreadable, malformed or empty input stops the run
with one line naming the file (and line), exit status 1, and no output left behind.
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
    group = parser.add_argument_group("output")
    group.add_argument("--output-prefix", required=True, help="prefix of the output pairs")
    group.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    group.add_argument(
        "--log-interval", type=int, default=10000, help="documents per progress line"
    )
    args = parser.parse_args(argv)
    if args.workers < 1 or args.log_interval < 1:
        parser.error("--workers and --log-interval must be at least 1")
    return args


def _is_jsonl(path: str, input_format: str) -> bool:
    if input_format == "auto":
        return path.endswith(JSONL_SUFFIXES)
    return input_format == "jsonl"


def _jsonl_documents(path: str, keys: list[str]) -> Iterator[dict[str, str]]:
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
                if not isinstance(record.get(key), str):
                    problem = "missing" if key not in record else "not a string"
                    raise InputError(f"{path}:{number}: key {key!r} is {problem}")
            yield {key: record[key] for key in keys}


def _text_documents(path: str, per_line: bool) -> Iterator[dict[str, str]]:
    with open(path, encoding="utf-8") as stream:
        if not per_line:
            text = stream.read()
            if text.strip():
                yield {"text": text}
            return
        for line in stream:
            if line.strip():
                yield {"text": line.rstrip("\n")}


def read_documents(args: argparse.Namespace) -> Iterator[dict[str, str]]:
    """Every document of every input, as {key: text}; raises InputError naming the file."""
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

    def __init__(self, documents: Iterator[dict[str, str]]) -> None:
        self.documents = documents
        self.error: InputError | None = None

    def __iter__(self) -> Iterator[dict[str, str]]:
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


def _encode(document: dict[str, str]) -> tuple[dict[str, list[int]], int]:
    """Token ids per key (EOD appended to non-empty documents if asked), and UTF-8 bytes read."""
    encoded, size = {}, 0
    for key, text in document.items():
        ids = _tokenizer.tokenize(text)
        if _append_eod and ids:
            ids.append(_tokenizer.eod)
        encoded[key] = ids
        size += len(text.encode("utf-8"))
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
        f"done: {count} documents, {tokens} tokens in {seconds:.1f} s -> "
        + ", ".join(f"{p}.bin/.idx" for p in prefixes.values()),
        file=sys.stderr,
    )
    return 0


def _write(
    args: argparse.Namespace,
    documents: _Guarded,
    tokenizer_args: dict[str, Any],
    builders: dict[str, IndexedDatasetBuilder],
) -> tuple[int, int, float]:
    """Tokenize every document into the builders; returns documents, tokens and seconds."""
    start, count, size, tokens = time.time(), 0, 0, 0
    for encoded, nbytes in _encoded_stream(args, documents, tokenizer_args):
        for key, ids in encoded.items():
            builders[key].add_document(ids)
            tokens += len(ids)
        count, size = count + 1, size + nbytes
        if count % args.log_interval == 0:
            elapsed = max(time.time() - start, 1e-9)
            print(
                f"processed {count} documents ({count / elapsed:.0f} docs/s, "
                f"{size / elapsed / 1e6:.2f} MB/s)",
                file=sys.stderr,
            )
    return count, tokens, time.time() - start


if __name__ == "__main__":
    sys.exit(main())
