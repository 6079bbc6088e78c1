"""pretrain_gpt.py's settings: derived sizes, start-up errors that name what to change,
and the README's demo command."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from megapp.training import arguments
from megapp.training.arguments import ArgumentsError, build_parser, parse_args, validate_args

ROOT = Path(__file__).resolve().parents[1]
BASE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --lr 1e-3 --train-iters 10 --use-default-corpus"
)


def args_for(extra: str = "", world_size: int = 8, base: str = BASE):
    args = build_parser().parse_args(shlex.split(f"{base} {extra}"))
    return validate_args(args, world_size)


def test_layout_and_microbatches_are_derived():
    args = args_for(
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --global-batch-size 32"
    )
    assert (args.data_parallel_size, args.num_microbatches) == (2, 8)  # 32 / (2 × 2)
    assert args.virtual_pipeline_model_parallel_size is None
    assert args.max_position_embeddings == 32 and args.ffn_hidden_size == 256
    assert args.lr_decay_iters == 10 and args.params_dtype == torch.float32
    default = args_for("--tensor-model-parallel-size 2")
    assert (default.global_batch_size, default.num_microbatches) == (8, 1)  # micro × dp 4
    interleaved = args_for(
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
        "--global-batch-size 16",
        world_size=4,
    )
    assert interleaved.virtual_pipeline_model_parallel_size == 2  # 4 layers / (2 stages × 1)
    assert (interleaved.data_parallel_size, interleaved.num_microbatches) == (2, 4)
    gqa = args_for("--num-query-groups 2 --swiglu --bf16", world_size=1)
    assert gqa.group_query_attention and gqa.num_query_groups == 2
    # 8·64/3 = 170, rounded down to a multiple of 64
    assert gqa.ffn_hidden_size == 128 and gqa.params_dtype == torch.bfloat16


ERRORS = [
    # (extra flags, world size, what the message must say)
    (
        "--global-batch-size 30 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
        8,
        r"--global-batch-size \(30\) is not divisible by --micro-batch-size × data-parallel "
        r"size \(2 × 2 = 4\); use a global batch of 28 or 32",
    ),
    (
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
        6,
        r"world size 6 is not divisible by --tensor-model-parallel-size × "
        r"--pipeline-model-parallel-size \(2 × 2 = 4\)",
    ),
    (
        "--pipeline-model-parallel-size 3",
        3,
        r"--num-layers \(4\) is not divisible by --pipeline-model-parallel-size \(3\); "
        r"use 3 or 6 layers",
    ),
    (
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3",
        2,
        r"--num-layers \(4\) is not divisible by --pipeline-model-parallel-size × "
        r"--num-layers-per-virtual-pipeline-stage \(2 × 3 = 6\)",
    ),
    (
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
        "--global-batch-size 6",
        2,
        r"interleaved pipeline schedule needs the number of microbatches \(3 = .*\) to be a "
        r"multiple of --pipeline-model-parallel-size \(2\); use a global batch of 4 or 8",
    ),
    (
        "--tensor-model-parallel-size 8",
        8,
        r"--num-attention-heads \(4\) is not divisible by --tensor-model-parallel-size \(8\)",
    ),
    ("--hidden-size 66", 1, r"--hidden-size \(66\) is not divisible by --num-attention-heads"),
    ("--num-query-groups 3", 1, r"--num-attention-heads \(4\) is not a multiple of"),
    ("--group-query-attention", 1, r"--group-query-attention needs --num-query-groups"),
    (
        "--max-position-embeddings 16",
        1,
        r"--seq-length \(32\) exceeds --max-position-embeddings \(16\); raise",
    ),
    ("--bf16 --fp16", 1, r"--bf16 and --fp16 are both set; choose one"),
    ("--loss-scale 128", 1, r"--loss-scale only applies with --fp16"),
    ("--sequence-parallel", 1, r"--sequence-parallel needs --tensor-model-parallel-size > 1"),
    ("--recompute-granularity full", 1, r"needs --recompute-method uniform\|block"),
    ("--recompute-method block", 1, r"only apply with --recompute-granularity full"),
    ("--min-lr 1e-2", 1, r"need 0 <= --min-lr <= --lr"),
    ("--lr-warmup-iters 20", 1, r"--lr-warmup-iters \(20\) must be between 0 and"),
    ("--save-interval 5", 1, r"--save-interval needs --save DIR"),
    ("--ckpt-step 5", 1, r"--ckpt-step needs --load DIR"),
    ("--data-path 30 a 70", 1, r"--data-path needs one prefix or weight/prefix pairs"),
    ("--split 1,x", 1, r"--split: split '1,x' must be"),
    ("--tokenizer-type GPT2BPETokenizer", 1, r"needs --vocab-file and --merge-file"),
    ("--micro-batch-size 0", 1, r"--micro-batch-size must be >= 1, got 0"),
]


@pytest.mark.parametrize(("extra", "world_size", "message"), ERRORS)
def test_invalid_settings_say_what_to_change(extra, world_size, message):
    base = BASE.replace("--use-default-corpus", "") if "--data-path" in extra else BASE
    with pytest.raises(ArgumentsError, match=message):
        args_for(extra, world_size, base)


def test_missing_data_and_required_flags():
    no_data = BASE.replace("--use-default-corpus", "")
    with pytest.raises(ArgumentsError, match=r"no training data: give --data-path PREFIX .* or "):
        args_for(base=no_data)
    with pytest.raises(ArgumentsError, match=r"--data-path and --use-default-corpus are both set"):
        args_for("--data-path corpus_text_document")
    for flag in ("--lr 1e-3", "--train-iters 10", "--seq-length 32", "--micro-batch-size 2"):
        name = flag.split()[0]
        with pytest.raises(ArgumentsError, match=f"{name} is required"):
            args_for(base=BASE.replace(flag, ""))


def test_tensorboard_dir_needs_tensorboard():
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ArgumentsError, match=r"--tensorboard-dir needs the tensorboard"):
            args_for("--tensorboard-dir tb", 1)
    else:
        assert args_for("--tensorboard-dir tb", 1).tensorboard_dir == "tb"


def test_command_line_error_exits_2_with_the_message(capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as stop:
        parse_args(shlex.split(f"{BASE} --bf16 --fp16"), world_size=1)
    assert stop.value.code == 2
    assert "error: --bf16 and --fp16 are both set; choose one" in capsys.readouterr().err
    # A node's other processes leave the message to its first one, which torchrun lets print
    # before it stops them; one still running after the grace prints it itself.
    monkeypatch.setenv("LOCAL_RANK", "3")
    waited = []
    monkeypatch.setattr(arguments.time, "sleep", waited.append)
    with pytest.raises(SystemExit) as stop:
        parse_args(shlex.split(f"{BASE} --bf16 --fp16"), world_size=1)
    assert stop.value.code == 2 and waited == [arguments.ERROR_GRACE_S]
    assert "error: --bf16 and --fp16 are both set; choose one" in capsys.readouterr().err


def _words(command: str) -> list[str]:
    return shlex.split(command.replace("\\\n", " "))


def test_readme_runs_the_cpu_demo_script():
    """The README's first command is the CPU demo script's torchrun command."""
    readme = (ROOT / "README.md").read_text()
    demo = re.findall(r"```bash\n(.+?)\n```", readme)[0]
    script = (ROOT / "examples" / "pretrain_gpt_cpu_demo.sh").read_text()
    launch = script[script.index("torchrun") :].strip()
    script_words = [w for w in _words(launch) if w != "$@"]
    assert _words(demo[demo.index("torchrun") :]) == script_words
    # and it is a valid layout for its 8 processes
    flags = script_words[script_words.index("pretrain_gpt.py") + 1 :]
    args = validate_args(build_parser().parse_args(flags), 8)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    assert args.data_parallel_size == 2
