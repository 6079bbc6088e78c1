"""pretrain_gpt.py's settings: the typed config built from the flags, derived sizes,
start-up errors that name what to change (each rule checked once, where it lives, its
field names translated to flags), and the README's demo command."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from megapp.models import build_gpt_chunks
from megapp.training import arguments
from megapp.training.arguments import ArgumentsError, config_from_flags, parse_args
from megapp.training.config import as_flags
from tests.support import PRETRAIN_BASE, args_for

ROOT = Path(__file__).resolve().parents[1]
BASE = PRETRAIN_BASE


def test_layout_and_microbatches_are_derived():
    config = args_for(
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --global-batch-size 32"
    )
    assert (config.data_parallel_size, config.num_microbatches) == (2, 8)  # 32 / (2 × 2)
    assert config.virtual_pipeline_model_parallel_size is None
    gpt = config.gpt_config(vocab_size=257)
    assert gpt.max_position_embeddings == 32 and gpt.ffn_hidden_size == 256
    assert gpt.vocab_size == 257 and gpt.make_vocab_size_divisible_by == 128
    assert config.optimizer.lr_decay_iters == 10 and gpt.params_dtype == torch.float32
    default = args_for("--tensor-model-parallel-size 2")
    assert (default.training.global_batch_size, default.num_microbatches) == (8, 1)  # micro × dp
    interleaved = args_for(
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
        "--global-batch-size 16",
        world_size=4,
    )
    assert interleaved.virtual_pipeline_model_parallel_size == 2  # 4 layers / (2 stages × 1)
    assert (interleaved.data_parallel_size, interleaved.num_microbatches) == (2, 4)
    gqa = args_for("--num-query-groups 2 --swiglu --bf16", world_size=1).gpt_config(257)
    assert gqa.num_query_groups == 2 and gqa.activation == "swiglu"
    # 8·64/3 = 170, rounded down to a multiple of 64
    assert gqa.ffn_hidden_size == 128 and gqa.params_dtype == torch.bfloat16


def test_the_config_is_built_once_and_reads_like_the_flags():
    config = args_for("--tensor-model-parallel-size 2 --lr-warmup-iters 3")
    assert config.parallel.tensor_model_parallel_size == 2 and config.optimizer.lr == 1e-3
    with pytest.raises(AttributeError):  # frozen: nothing changes it on its way through
        config.optimizer.lr = 1.0
    plain = config.to_dict()
    assert plain["optimizer"]["lr_warmup_iters"] == 3 and plain["world_size"] == 8
    assert plain["derived"] == {
        "data_parallel_size": 4,
        "virtual_pipeline_model_parallel_size": None,
        "num_microbatches": 1,
        "params_dtype": "torch.float32",
    }
    assert as_flags("num_attention_heads (4) and layernorm_epsilon") == (
        "--num-attention-heads (4) and --norm-epsilon"
    )


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
        r"--pipeline-model-parallel-size \(2 × 2 = 4\); launch a multiple of 4 processes",
    ),
    (
        "--pipeline-model-parallel-size 3",
        3,
        r"--num-layers \(4\) is not divisible by --pipeline-model-parallel-size \(3\); "
        r"use 3 or 6 layers or another layout",
    ),
    (
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3",
        2,
        r"--num-layers \(4\) is not divisible by --pipeline-model-parallel-size × "
        r"--num-layers-per-virtual-pipeline-stage \(2 × 3 = 6\)",
    ),
    (
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
        "--global-batch-size 2",
        2,
        r"--global-batch-size 2 / \(--micro-batch-size 2 × data-parallel size 1\) gives 1 "
        r"microbatches, which the interleaved-1f1b schedule cannot run: .*at least as many "
        r"microbatches as pipeline stages \(2\), got 1",
    ),
    (
        "--num-layers 6 --pipeline-model-parallel-size 2 --pipeline-schedule zb-v "
        "--global-batch-size 8",
        2,
        r"--pipeline-schedule zb-v places two model chunks on every rank in a V, so "
        r"--num-layers \(6\) must split into 2 × --pipeline-model-parallel-size \(2\) = 4 "
        r"virtual stages; use 4 or 8 layers",
    ),
    (
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
        "--pipeline-schedule dualpipev --global-batch-size 6",
        2,
        r"gives 3 microbatches, which the dualpipev schedule cannot run: dualpipev needs at "
        r"least 2p = 4 microbatches",
    ),
    (
        "--pipeline-model-parallel-size 2 --global-batch-size 8 "
        "--microbatch-group-size-per-virtual-pipeline-stage 2",
        2,
        r"a microbatch group size applies to interleaved-1f1b, not 1f1b",
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
    ("--lr-warmup-iters 20", 1, r"--lr-warmup-iters \(20\) must not exceed --lr-decay-iters"),
    ("--save-interval 5", 1, r"--save-interval needs --save DIR"),
    ("--ckpt-step 5", 1, r"--ckpt-step needs --load DIR"),
    ("--data-path 30 a 70", 1, r"--data-path needs one prefix or weight/prefix pairs"),
    ("--split 1,x", 1, r"--split: split '1,x' must be"),
    ("--tokenizer-type GPT2BPETokenizer --merge-file m.txt", 1, r"needs both --vocab-file and"),
    ("--micro-batch-size 0", 1, r"--micro-batch-size must be >= 1, got 0"),
    ("--profile-iteration 0", 1, r"--profile-iteration must be >= 1, got 0"),
    ("--profile-iteration 10", 1, r"--profile-iteration 10 must be below --train-iters \(10\)"),
    ("--save-hf out", 1, r"--save-hf needs --hf-model-type \(gpt2 \| gpt_neox \| llama"),
    ("--load-hf /no/such/dir", 1, r"--load-hf /no/such/dir: no such directory"),
    ("--swiglu --gelu-erf", 1, r"--swiglu and --gelu-erf both choose the activation"),
    ("--rotary-percent 0.5", 1, r"--rotary-percent needs --position-embedding-type 'rope'"),
    ("--add-qkv-bias", 1, r"--add-qkv-bias is for models without biases on the linear layers"),
    (
        "--context-parallel-size 3",
        6,
        r"sequence length 32 is not divisible by 2 × context-parallel size \(2 × 3 = 6\)",
    ),
    (
        "--context-parallel-size 4 --attention-dropout 0 --hidden-dropout 0",
        6,
        r"world size 6 is not divisible by --tensor-model-parallel-size × "
        r"--context-parallel-size × --pipeline-model-parallel-size \(1 × 4 × 1 = 4\)",
    ),
    ("--context-parallel-size 2", 2, r"--attention-dropout \(0.1\) is not supported with"),
    (
        "--context-parallel-size 8 --cp-comm-type a2a --attention-dropout 0 --seq-length 32",
        8,
        r"--cp-comm-type 'a2a' splits each tensor-parallel rank's 4 query heads over "
        r"--context-parallel-size \(8\)",
    ),
    (
        "--context-parallel-size 2 --tensor-model-parallel-size 4 --sequence-parallel "
        "--attention-dropout 0 --seq-length 12",
        8,
        r"--sequence-parallel splits each context-parallel rank's 6 tokens over "
        r"--tensor-model-parallel-size \(4\)",
    ),
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
        assert args_for("--tensorboard-dir tb", 1).logging.tensorboard_dir == "tb"


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
    config = config_from_flags(flags, 8)
    parallel = config.parallel
    assert (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size) == (2, 2)
    assert config.data_parallel_size == 2


def test_uneven_first_and_last_stages_reach_the_model_chunks():
    """Megatron's --decoder-first/last-pipeline-num-layers, with or without virtual stages
    (asked for by count, Megatron's way with uneven stages), split the model as they say."""
    uneven = "--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 3"
    config = args_for(f"--num-layers 8 --pipeline-model-parallel-size 4 {uneven}", 4)
    gpt = config.gpt_config(vocab_size=257)
    assert (gpt.num_layers_in_first_pipeline_stage, gpt.num_layers_in_last_pipeline_stage) == (
        1,
        3,
    )
    assert config.to_dict()["parallel"]["decoder_last_pipeline_num_layers"] == 3
    interleaved = args_for(
        "--num-layers 12 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
        "--decoder-first-pipeline-num-layers 4 --global-batch-size 8",
        2,
    )
    assert interleaved.virtual_pipeline_model_parallel_size == 2
    assert interleaved.schedule.name == "interleaved-1f1b"
    for built, want in ((config, [[1], [2], [2], [3]]), (interleaved, [[2, 2], [4, 4]])):
        pp = built.parallel.pipeline_model_parallel_size
        layers = [
            [
                len(chunk.decoder.layers)
                for chunk in build_gpt_chunks(
                    built.gpt_config(vocab_size=257),
                    pp_rank=rank,
                    pp_size=pp,
                    vpp_size=built.virtual_pipeline_model_parallel_size,
                    schedule=built.schedule,
                )
            ]
            for rank in range(pp)
        ]
        assert layers == want


def test_embedding_and_loss_counted_in_the_split_reach_the_model_chunks():
    """Megatron's --account-for-embedding/loss-in-pipeline-split: 6 layers and the two
    counted split 4 per rank, one per virtual stage (--num-layers-per-virtual-pipeline-stage
    counts them too), so the first chunk holds only the embedding and the last only the
    loss."""
    counted = "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split"
    config = args_for(
        f"--num-layers 6 --pipeline-model-parallel-size 2 "
        f"--num-layers-per-virtual-pipeline-stage 1 --global-batch-size 4 {counted}",
        2,
    )
    assert config.virtual_pipeline_model_parallel_size == 4
    gpt = config.gpt_config(vocab_size=257)
    assert gpt.account_for_embedding_in_pipeline_split and gpt.account_for_loss_in_pipeline_split
    layers = [
        [
            len(chunk.decoder.layers)
            for chunk in build_gpt_chunks(
                gpt, pp_rank=rank, pp_size=2, vpp_size=4, schedule=config.schedule
            )
        ]
        for rank in range(2)
    ]
    assert layers == [[0, 1, 1, 1], [1, 1, 1, 0]]


UNEVEN_ERRORS = [
    (
        "--pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split",
        2,
        r"^--num-layers \(4\) \+ embedding = 5 is not divisible by "
        r"--pipeline-model-parallel-size \(2\); use 4 or 6 counted layers or another pipeline "
        r"size$",
    ),
    (
        "--pipeline-model-parallel-size 2 --account-for-loss-in-pipeline-split "
        "--decoder-last-pipeline-num-layers 2",
        2,
        r"^--decoder-first/last-pipeline-num-layers and "
        r"--account-for-embedding/loss-in-pipeline-split both size the end stages; give one$",
    ),
    # (extra flags, world size, what the message must say)
    (
        "--decoder-first-pipeline-num-layers 2",
        1,
        r"^--decoder-first-pipeline-num-layers needs --pipeline-model-parallel-size >= 2, "
        r"got 1; drop it or use more pipeline stages$",
    ),
    (
        "--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 0",
        2,
        r"^--decoder-first-pipeline-num-layers must be >= 1, got 0$",
    ),
    (
        "--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1 "
        "--decoder-last-pipeline-num-layers 2",
        2,
        r"^with 2 pipeline stages, --decoder-first-pipeline-num-layers and "
        r"--decoder-last-pipeline-num-layers \(1 \+ 2\) must add up to --num-layers \(4\)$",
    ),
    (
        "--num-layers 8 --pipeline-model-parallel-size 4 --decoder-last-pipeline-num-layers 3",
        4,
        r"^--decoder-last-pipeline-num-layers leaves 5 of --num-layers \(8\) to the other 3 "
        r"pipeline stages, which must divide them evenly with at least one layer per chunk$",
    ),
    (
        "--num-layers 8 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
        "--decoder-first-pipeline-num-layers 3",
        2,
        r"^--decoder-first-pipeline-num-layers \(3\) is not divisible by virtual pipeline "
        r"size \(2\): the rank's 2 chunks hold equal shares; use 2 or 4$",
    ),
    (
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
        "--decoder-first-pipeline-num-layers 2",
        2,
        r"^--num-layers-per-virtual-pipeline-stage assumes even stages; with "
        r"--decoder-first/last-pipeline-num-layers give --num-virtual-stages-per-pipeline-rank "
        r"instead$",
    ),
    (
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
        "--num-virtual-stages-per-pipeline-rank 2",
        2,
        r"^--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
        r"both ask for virtual stages; give one$",
    ),
    (
        "--num-virtual-stages-per-pipeline-rank 2",
        1,
        r"^virtual pipeline size 2 needs pipeline parallelism, but "
        r"--pipeline-model-parallel-size is 1",
    ),
    (
        "--pipeline-schedule zb-v",
        1,
        r"^--pipeline-schedule zb-v places two model chunks on every rank in a V over the "
        r"pipeline's ranks: it needs --pipeline-model-parallel-size > 1$",
    ),
    (
        "--pipeline-model-parallel-size 2 --decoder-last-pipeline-num-layers -1",
        2,
        r"^--decoder-last-pipeline-num-layers must be >= 1, got -1$",
    ),
]


@pytest.mark.parametrize("extra, world_size, message", UNEVEN_ERRORS)
def test_bad_uneven_stages_fail_in_one_line_naming_the_flags(extra, world_size, message):
    with pytest.raises(ArgumentsError, match=message) as info:
        args_for(extra, world_size)
    assert "\n" not in str(info.value)


def test_the_command_line_checks_its_outputs(tmp_path, capsys, monkeypatch):
    """parse_args (what pretrain_gpt.py runs) refuses an output it could not write; the
    config alone (what the planner checks, for paths of another machine) does not look."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    (tmp_path / "metrics").mkdir()
    flags = shlex.split(f"{BASE} --metrics-path {tmp_path / 'metrics'}")
    with pytest.raises(SystemExit) as stop:
        parse_args(flags, world_size=1)
    assert stop.value.code == 2
    assert capsys.readouterr().err.endswith(  # the program's name is pytest's here
        f": error: --metrics-path {tmp_path / 'metrics'}: is a directory; --metrics-path "
        "names a file\n"
    )
    assert config_from_flags(flags, 1).logging.metrics_path == str(tmp_path / "metrics")


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
def test_v_schedules_derive_their_two_chunks_per_rank(name):
    """A V runs exactly two chunks per rank: with no virtual-stage flag the layers per
    virtual stage follow (4 layers over 2 ranks × 2 chunks: one each), even and uneven."""
    config = args_for(
        f"--pipeline-model-parallel-size 2 --pipeline-schedule {name} --global-batch-size 8", 2
    )
    assert config.virtual_pipeline_model_parallel_size == 2
    assert config.schedule.name == name and config.schedule.placement == ((0, 3), (1, 2))
    uneven = args_for(
        f"--num-layers 8 --pipeline-model-parallel-size 2 --pipeline-schedule {name} "
        "--decoder-first-pipeline-num-layers 2 --global-batch-size 8",
        2,
    )
    assert uneven.virtual_pipeline_model_parallel_size == 2
    for built, want in ((config, [[1, 1], [1, 1]]), (uneven, [[1, 1], [3, 3]])):
        layers = [
            [
                len(chunk.decoder.layers)
                for chunk in build_gpt_chunks(
                    built.gpt_config(vocab_size=257),
                    pp_rank=rank,
                    pp_size=2,
                    vpp_size=built.virtual_pipeline_model_parallel_size,
                    schedule=built.schedule,
                )
            ]
            for rank in range(2)
        ]
        assert layers == want
    # the same two chunks asked for explicitly are the same run
    explicit = args_for(
        f"--pipeline-model-parallel-size 2 --pipeline-schedule {name} --global-batch-size 8 "
        "--num-layers-per-virtual-pipeline-stage 1",
        2,
    )
    assert explicit.schedule == config.schedule


SCHEDULE_ERRORS = [
    # (extra flags, what the message must say): the schedule's own rule, not the batch size
    (
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
        "--pipeline-schedule 1f1b --global-batch-size 8",
        r"^--pipeline-schedule 1f1b runs one model chunk per rank, but "
        r"--num-layers-per-virtual-pipeline-stage 1 gives 2; use interleaved-1f1b for 2, or "
        r"drop the virtual stages$",
    ),
    (
        "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
        "--pipeline-schedule gpipe --global-batch-size 8",
        r"^--pipeline-schedule gpipe runs one model chunk per rank, but "
        r"--num-virtual-stages-per-pipeline-rank 2 gives 2",
    ),
    (
        "--num-layers 8 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
        "--pipeline-schedule zb-v --global-batch-size 8",
        r"^--pipeline-schedule zb-v places two model chunks on every rank in a V, but "
        r"--num-layers-per-virtual-pipeline-stage 1 gives 4; leave the flag out",
    ),
    (
        "--pipeline-model-parallel-size 2 --pipeline-schedule interleaved-1f1b "
        "--global-batch-size 8",
        r"^--pipeline-schedule interleaved-1f1b runs at least 2 model chunks per rank; give "
        r"--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank$",
    ),
    (
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
        "--microbatch-group-size-per-virtual-pipeline-stage 8 --global-batch-size 8",
        r"^the interleaved-1f1b schedule cannot run this layout: the microbatch group size of "
        r"interleaved-1f1b must lie between the pipeline size 2 and the number of "
        r"microbatches 4, got 8$",
    ),
]


@pytest.mark.parametrize("extra, message", SCHEDULE_ERRORS)
def test_a_schedule_error_names_the_schedule_rule_not_the_batch_size(extra, message):
    """The global batch of these runs is fine (4 microbatches); the message says so by not
    blaming it."""
    with pytest.raises(ArgumentsError, match=message) as info:
        args_for(extra, world_size=2)
    assert "microbatches, which" not in str(info.value)
    assert "--global-batch-size" not in str(info.value)
