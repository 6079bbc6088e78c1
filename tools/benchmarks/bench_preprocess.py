"""Preprocessing speed: tools/data/preprocess_data.py with GPT-2's BPE, tiktoken against pure
Python.

    python tools/benchmarks/bench_preprocess.py --workers 1 2 --rounds 3 --json runs/preprocess.json

The corpus is the default corpus's text (this Python's standard-library sources, one JSON
line per file). Every round runs the tool once per (encoder, workers) in a rotating
order; tokens/s is the tool's token count over its wall time, start-up included. Before
timing, each encoder's `.bin`/`.idx` output over the whole corpus is compared byte for
byte: the library is used for encoding only because the ids are identical.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megapp.benchmarks import common
from megapp.data.corpus import stdlib_source_files
from megapp.data.gpt2_bpe import GPT2BPETokenizer

TOOL = Path(__file__).resolve().parents[1] / "data" / "preprocess_data.py"
ENCODERS = ("python", "tiktoken")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each variant")
    parser.add_argument(
        "--max-files", type=int, default=None, help="only the first N source files (a quick run)"
    )
    parser.add_argument("--workdir", default=None, help="where the corpus and outputs go")
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args()


def write_corpus(path: Path, max_files: int | None) -> tuple[int, int]:
    """The default corpus's documents as JSON lines; returns documents and bytes."""
    files = stdlib_source_files()[:max_files]
    with open(path, "w", encoding="utf-8") as stream:
        for source in files:
            text = source.read_bytes().decode("utf-8", errors="replace")
            stream.write(json.dumps({"text": text}) + "\n")
    return len(files), path.stat().st_size


def run_tool(corpus: Path, prefix: Path, encoder: str, workers: int) -> tuple[float, int]:
    """Run the tool once; returns (wall seconds, tokens written)."""
    command = [
        sys.executable,
        str(TOOL),
        *("--input", str(corpus), "--output-prefix", str(prefix)),
        *("--tokenizer-type", "GPT2BPETokenizer", "--tokenizer-backend", encoder),
        *("--append-eod", "--workers", str(workers), "--log-interval", "1e9"),
    ]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr}")
    match = re.search(r"done: \d+ documents, (\d+) tokens", done.stderr)
    if match is None or f"{encoder} encoder" not in done.stderr:
        raise RuntimeError(f"unexpected tool output:\n{done.stderr}")
    return seconds, int(match.group(1))


def same_output(prefix_a: Path, prefix_b: Path) -> bool:
    suffix = "_text_document"
    return all(
        filecmp.cmp(f"{prefix_a}{suffix}{ext}", f"{prefix_b}{suffix}{ext}", shallow=False)
        for ext in (".bin", ".idx")
    )


def main() -> None:
    args = parse_args()
    print(f"$ {common.command_line()}")
    print(f"machine: {common.machine()}; load {common.load_average()}")
    tokenizer = GPT2BPETokenizer()
    if tokenizer.backend != "tiktoken":
        raise SystemExit("error: tiktoken is not installed (pip install -e '.[gpt2]')")
    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        root = Path(work)
        documents, size = write_corpus(root / "corpus.jsonl", args.max_files)
        print(f"corpus: {documents} documents, {size / 1e6:.1f} MB of JSON lines")
        # The proof first: both encoders write the same files for the whole corpus.
        outputs = {e: root / f"check_{e}" for e in ENCODERS}
        tokens = {e: run_tool(root / "corpus.jsonl", outputs[e], e, 1)[1] for e in ENCODERS}
        identical = same_output(outputs["python"], outputs["tiktoken"])
        print(f"identical .bin/.idx from both encoders: {identical} ({tokens['python']} tokens)")
        if not identical:
            raise SystemExit("error: the encoders disagree; not timing them")
        calls = {
            f"{e}/{w}": (lambda e=e, w=w: run_tool(root / "corpus.jsonl", root / "t", e, w)[0])
            for e in ENCODERS
            for w in args.workers
        }
        seconds = common.interleaved(calls, args.rounds)
    count = tokens["python"]
    rows, results = [], []
    for e in ENCODERS:
        for w in args.workers:
            median = common.median(seconds[f"{e}/{w}"])
            base = common.median(seconds[f"python/{w}"])
            rows.append(
                [e, str(w), f"{median:.2f}", f"{count / median:,.0f}", f"{base / median:.2f}"]
            )
            results.append(
                {"encoder": e, "workers": w, "seconds": seconds[f"{e}/{w}"], "tokens": count}
            )
    header = ["encoder", "workers", "median s", "tokens/s", "speed-up over python"]
    print(common.markdown_table(header, rows, "llrrr"))
    if args.json:
        common.write_json(
            args.json,
            {
                "command": common.command_line(),
                "machine": common.machine(),
                "documents": documents,
                "json_bytes": size,
                "identical": identical,
                "results": results,
            },
        )


if __name__ == "__main__":
    main()
