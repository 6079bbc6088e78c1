"""Merge `.bin`/`.idx` pairs into one, documents in order, tokens copied byte for byte.

    python tools/data/merge_datasets.py --input data/shards \
        --output-prefix data/corpus_text_document
    python tools/data/merge_datasets.py --input data/a_text_document data/b_text_document \\
        --output-prefix data/ab_text_document

Each `--input` is a pair's path prefix, or a directory whose pairs are all taken in
sorted name order (as Megatron-LM's merge tool does). All pairs must hold the same token
dtype. The result equals Megatron-Core's `IndexedDatasetBuilder.add_index` over the same
inputs, byte for byte. A missing, corrupt or mismatched input ends the run with one
line and no output.
"""

from __future__ import annotations

import argparse
import os
import sys

from megapp.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    data_file_path,
    index_file_path,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--input", nargs="+", required=True, help="pair prefixes, or directories of pairs"
    )
    parser.add_argument("--output-prefix", required=True, help="prefix of the merged pair")
    return parser.parse_args(argv)


def input_prefixes(inputs: list[str]) -> list[str]:
    """Every pair prefix named by `inputs`, directories expanded in sorted order."""
    prefixes = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(
                os.path.join(item, name[: -len(".idx")])
                for name in os.listdir(item)
                if name.endswith(".idx")
            )
            if not found:
                raise ValueError(f"{item}: no .idx files in this directory")
            prefixes += found
        else:
            prefixes.append(item)
    return prefixes


def merge(prefixes: list[str], output_prefix: str) -> tuple[int, int]:
    """Write the merged pair; returns its documents and sequences."""
    first = IndexedDataset(prefixes[0])
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(data_file_path(output_prefix), first.dtype)
    try:
        for prefix in prefixes:
            builder.add_index(prefix)
    except BaseException:
        builder.finalize(index_file_path(output_prefix))
        for path in (data_file_path(output_prefix), index_file_path(output_prefix)):
            os.remove(path)
        raise
    builder.finalize(index_file_path(output_prefix))
    return len(builder.document_indices) - 1, len(builder.sequence_lengths)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        prefixes = input_prefixes(args.input)
        if os.path.abspath(args.output_prefix) in {os.path.abspath(p) for p in prefixes}:
            raise ValueError(f"{args.output_prefix} is also an input")
        documents, sequences = merge(prefixes, args.output_prefix)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(
        f"done: {len(prefixes)} pairs, {documents} documents, {sequences} sequences -> "
        f"{args.output_prefix}.bin/.idx",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
