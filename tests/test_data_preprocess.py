"""tools/data/preprocess_data.py end to end: jsonl and text inputs, workers, and its error lines."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megapp.data.indexed_dataset import IndexedDataset
from megapp.data.tokenizers import ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "data" / "preprocess_data.py"
RECORDS = [
    {"text": "first document", "title": "one"},
    {"text": "", "title": "empty text"},
    {"text": "naïve ünïcode ✓", "title": "three"},
    *({"text": f"document number {i}\n", "title": f"t{i}"} for i in range(40)),
]


def run_tool(*args):
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run(
        [sys.executable, str(TOOL), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def write_jsonl(path, records, trailing=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + trailing, encoding="utf-8")
    return path


def test_jsonl_with_two_keys_and_two_workers(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", RECORDS, trailing="\n")  # a blank line is skipped
    out = tmp_path / "out" / "corpus"
    result = run_tool(
        "--input", source, "--output-prefix", out, "--json-keys", "text", "title",
        "--append-eod", "--workers", 2, "--log-interval", 1e-9,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"processed {len(RECORDS)} documents" in result.stderr
    assert "100.0% of the input, ETA 0m00s" in result.stderr
    tokenizer = ByteTokenizer()
    for key in ("text", "title"):
        dataset = IndexedDataset(f"{out}_{key}_document")
        assert dataset.dtype == np.uint16
        assert dataset.num_documents == len(RECORDS)
        # An empty text is a document with no sequence, as in Megatron-LM's tool.
        assert len(dataset) == sum(1 for r in RECORDS if r[key])
        for i, record in enumerate(RECORDS):
            expected = tokenizer.tokenize(record[key])
            if expected:  # EOD ends every non-empty document
                expected.append(tokenizer.eod)
            assert dataset.document(i).tolist() == expected, (key, i)


def megatron_lm_pair(prefix, texts, tokenizer):
    """What Megatron-LM's tools/preprocess_data.py writes for these texts with --append-eod:
    its encoding rule driving megatron-core's own IndexedDatasetBuilder."""
    mc_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    builder = mc_indexed.IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for text in texts:
        ids, lengths = [], []
        for sentence in text if isinstance(text, list) else [text]:
            sentence_ids = tokenizer.tokenize(sentence)
            if sentence_ids:
                ids += sentence_ids
                lengths.append(len(sentence_ids))
        if ids:
            ids.append(tokenizer.eod)
            lengths[-1] += 1
        builder.add_document(ids, lengths)
    builder.finalize(f"{prefix}.idx")


def test_output_is_byte_identical_to_megatron_lm_with_empty_texts_and_sentences(tmp_path):
    texts = ["", "one", ["first sentence. ", "", "second."], [], "  ", "", ["", ""], "last"]
    texts += [f"document {i}" if i % 4 else "" for i in range(40)]
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    result = run_tool("--input", source, "--output-prefix", tmp_path / "o", "--append-eod")
    assert result.returncode == 0, result.stderr
    megatron_lm_pair(tmp_path / "reference", texts, ByteTokenizer())
    for suffix in (".bin", ".idx"):
        ours = (tmp_path / f"o_text_document{suffix}").read_bytes()
        assert ours == (tmp_path / f"reference{suffix}").read_bytes(), suffix
    dataset = IndexedDataset(str(tmp_path / "o_text_document"))
    assert dataset.num_documents == len(texts)
    assert len(dataset) == 35  # 14 empty texts write no sequence; one text holds two


def test_plain_text_one_document_per_file_or_per_line(tmp_path):
    (tmp_path / "a.txt").write_text("alpha\nbeta\n\ngamma\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("delta", encoding="utf-8")
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    assert run_tool("--input", *files, "--output-prefix", tmp_path / "f").returncode == 0
    per_file = IndexedDataset(str(tmp_path / "f_text_document"))
    assert [bytes(per_file[i].tolist()) for i in range(2)] == [b"alpha\nbeta\n\ngamma\n", b"delta"]
    result = run_tool(
        "--input", *files, "--output-prefix", tmp_path / "l", "--one-document-per-line",
        "--append-eod",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    per_line = IndexedDataset(str(tmp_path / "l_text_document"))
    assert [bytes(per_line[i][:-1].tolist()) for i in range(4)] == [
        b"alpha",
        b"beta",
        b"gamma",
        b"delta",
    ]
    assert {int(per_line[i][-1]) for i in range(4)} == {256}


def test_gpt2_tokenizer_option(tmp_path):
    symbols = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "<|endoftext|>"]
    (tmp_path / "v.json").write_text(json.dumps({s: i for i, s in enumerate(symbols)}))
    (tmp_path / "m.txt").write_text("#version: 0.2\n")
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "ab c"}])
    result = run_tool(
        "--input", source, "--output-prefix", tmp_path / "g", "--tokenizer-type",
        "GPT2BPETokenizer", "--vocab-file", tmp_path / "v.json", "--merge-file",
        tmp_path / "m.txt", "--append-eod",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert IndexedDataset(str(tmp_path / "g_text_document"))[0].tolist() == [0, 1, 26, 2, 27]
    unknown = write_jsonl(tmp_path / "digits.jsonl", [{"text": "ab"}, {"text": "a1"}])
    failed = run_tool(
        "--input", unknown, "--output-prefix", tmp_path / "u", "--tokenizer-type",
        "GPT2BPETokenizer", "--vocab-file", tmp_path / "v.json", "--merge-file",
        tmp_path / "m.txt", "--workers", 2,
    )  # fmt: skip
    assert failed.returncode == 1
    assert failed.stderr.strip() == (
        f"error: tokenizing {unknown}: BPE symbol '1' is missing from the vocabulary"
    )
    assert not list(tmp_path.glob("u_*"))


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "ok"}\n{"text": oops}\n', "bad.jsonl:2: malformed JSON"),
        ('{"text": "ok"}\n{"body": "x"}\n', "bad.jsonl:2: key 'text' is missing"),
        ('{"text": 5}\n', "bad.jsonl:1: key 'text' is not a string"),
        ('["text"]\n', "bad.jsonl:1: expected a JSON object"),
        ("", "bad.jsonl: no documents"),
        ("\n\n", "bad.jsonl: no documents"),
    ],
)
def test_bad_input_fails_with_one_line_naming_the_file(tmp_path, content, message):
    (tmp_path / "bad.jsonl").write_text(content, encoding="utf-8")
    result = run_tool("--input", tmp_path / "bad.jsonl", "--output-prefix", tmp_path / "o")
    assert result.returncode == 1
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.glob("o_*"))  # no partial output left behind


def test_unreadable_and_undecodable_input(tmp_path):
    missing = run_tool("--input", tmp_path / "nope.txt", "--output-prefix", tmp_path / "o")
    assert missing.returncode == 1
    assert f"{tmp_path / 'nope.txt'}: cannot read" in missing.stderr
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    binary = run_tool(
        "--input", tmp_path / "latin1.txt", "--output-prefix", tmp_path / "o", "--workers", 2
    )
    assert binary.returncode == 1
    assert "latin1.txt: not UTF-8 text" in binary.stderr
    bad_tokenizer = run_tool(
        "--input", tmp_path / "latin1.txt", "--output-prefix", tmp_path / "o",
        "--tokenizer-type", "GPT2BPETokenizer", "--merge-file", tmp_path / "m.txt",
    )  # fmt: skip
    assert bad_tokenizer.returncode == 1
    assert "needs both --vocab-file and --merge-file" in bad_tokenizer.stderr
