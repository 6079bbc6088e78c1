"""Hugging Face models and megapp: print a model's flags, or export a checkpoint as a model.

    python tools/checkpoint/convert_hf.py flags HF_DIR [--max-position-embeddings N]
    python tools/checkpoint/convert_hf.py export CKPT_DIR --output HF_DIR [--model-type llama] \\
        [--iteration N] [--tokenizer-dir DIR] [--max-shard-size-mb 2048]

`flags` prints the pretrain_gpt.py model flags that build the model in HF_DIR, its dropout
included; train from its weights with `pretrain_gpt.py <those flags> --load-hf HF_DIR`
under any layout (each rank reads only its slices). `export` reads a megapp checkpoint
saved under any layout into one process and writes `config.json`,
`generation_config.json`, sharded safetensors with their index and, from
`--tokenizer-dir`, the tokenizer files. A model that came from a Hugging Face folder keeps
that folder's config with its checkpoints and gets it back (`--model-type` defaults to
its type); a model trained from scratch needs `--model-type` and takes its token ids from
the run's tokenizer. (`pretrain_gpt.py --save-hf DIR` exports at the end of a run from the
run's own layout.) Errors end with one line.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from megapp.checkpointing import load_checkpoint
from megapp.checkpointing.checkpoint import read_saved_settings
from megapp.models.gpt import build_gpt_chunks, gpt_config_from_saved
from megapp.models.hf_checkpoint import hf_gpt_config, kept_hf_config, read_hf_config, save_hf
from megapp.models.hf_config import MODEL_TYPES
from megapp.parallel_state import TrainGroups
from megapp.training.arguments import exit_with_error
from megapp.training.hf_start import pretrain_flags, run_eod

PROG = os.path.basename(__file__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    flags = commands.add_parser("flags", help="the pretrain_gpt.py flags of a HF model")
    flags.add_argument("hf_dir")
    flags.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="how far to run a RoPE model (a sliding-window model: at most its window)",
    )
    export = commands.add_parser("export", help="a megapp checkpoint as a HF model folder")
    export.add_argument("checkpoint")
    export.add_argument("--output", required=True, help="the HF folder to write")
    export.add_argument(
        "--model-type", choices=MODEL_TYPES, default=None, help="default: the imported model's"
    )
    export.add_argument("--iteration", type=int, default=None, help="default: the latest")
    export.add_argument("--tokenizer-dir", default=None, help="copy its tokenizer files")
    export.add_argument("--max-shard-size-mb", type=int, default=2048)
    return parser.parse_args(argv)


def flags(args: argparse.Namespace) -> str:
    context = {}
    if args.max_position_embeddings is not None:
        context["max_position_embeddings"] = args.max_position_embeddings
    config, _ = hf_gpt_config(args.hf_dir, **context)
    printed = pretrain_flags(config)
    if context and "--max-position-embeddings" not in printed:
        printed += ["--max-position-embeddings", str(config.max_position_embeddings)]
    return " ".join(printed)


# the layout of this process, whatever the checkpoint's (experts whole, none split)
ONE_PROCESS = dict(
    tensor_model_parallel_size=1,
    sequence_parallel=False,
    expert_model_parallel_size=1,
    expert_tensor_parallel_size=None,
)


def export(args: argparse.Namespace) -> str:
    kept = kept_hf_config(args.checkpoint)
    model_type = args.model_type
    if model_type is None:
        if kept is None:
            raise ValueError(
                f"{args.checkpoint} keeps no Hugging Face config (its model was trained from "
                f"scratch): give --model-type ({' | '.join(MODEL_TYPES)})"
            )
        model_type = read_hf_config(kept).get("model_type")
    fields, saved, iteration = read_saved_settings(args.checkpoint, args.iteration)
    config = gpt_config_from_saved(fields, **ONE_PROCESS)
    chunks = build_gpt_chunks(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the RNG streams of another layout are not restored
        load_checkpoint(
            args.checkpoint,
            chunks,
            groups=TrainGroups(),
            iteration=iteration,
            load_optimizer=False,
            load_rng=False,
        )
    save_hf(
        chunks,
        args.output,
        model_type,
        max_shard_bytes=args.max_shard_size_mb << 20,
        tokenizer_dir=args.tokenizer_dir,
        source_dir=kept,
        eod=None if kept is not None else run_eod(saved.get("data") or {}),
    )
    return f"done: iteration {iteration} of {args.checkpoint} -> {args.output} ({model_type})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "flags":
            print(flags(args))
        else:
            print(export(args), file=sys.stderr)
    except (OSError, ValueError, KeyError, ImportError) as error:
        exit_with_error(PROG, error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
