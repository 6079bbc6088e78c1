"""Text from a megapp checkpoint or a Hugging Face model, to see what a model learned.

    python tools/checkpoint/generate.py --load runs/ckpt --prompt "def main(" --max-new-tokens 64
    python tools/checkpoint/generate.py --hf path/to/hf_model --prompt "Once upon a time" \\
        --temperature 0.8 --top-k 50 --top-p 0.95 --seed 1
    python tools/checkpoint/generate.py --hf path/to/hf_model --prompt-ids 1,450,4996 --ids
    torchrun --nproc-per-node 2 tools/checkpoint/generate.py --hf path/to/hf_model --prompt "..."

Greedy unless `--temperature`, `--top-k` or `--top-p` is given. Under torchrun the model
is split over the ranks by tensor parallelism (heads and vocabulary) and rank 0 prints.
The tokenizer is the checkpoint run's (`--tokenizer-*` flags override it) or, for
`--hf`, the folder's own when it has one. `--prompt-ids` gives the prompt as token ids
(comma-separated) and prints ids; it needs no tokenizer (without one, a sequence stops
at the folder's `eos_token_id`). A key/value cache keeps generation linear in the length.
`--ids` prints token ids instead of text. Errors end with one line.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.distributed as dist

from megapp import parallel_state as ps
from megapp.checkpointing import load_checkpoint
from megapp.checkpointing.checkpoint import read_saved_settings
from megapp.data.tokenizers import TOKENIZER_TYPES, build_tokenizer
from megapp.models.generation import Sampling, generate
from megapp.models.gpt import build_gpt_chunks, gpt_config_from_saved
from megapp.models.hf_checkpoint import hf_gpt_config, load_hf, read_hf_config
from megapp.parallel_state import TrainGroups
from megapp.training.arguments import exit_with_error

PROG = os.path.basename(__file__)


def token_ids(text: str) -> list[int]:
    """``"1,2,3"`` as ``[1, 2, 3]``."""
    try:
        return [int(piece) for piece in text.split(",") if piece.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated token ids") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", help="a megapp checkpoint directory")
    source.add_argument("--hf", help="a Hugging Face model folder")
    parser.add_argument("--iteration", type=int, default=None, help="--load's iteration")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="text; repeat for a batch")
    prompt.add_argument(
        "--prompt-ids", action="append", type=token_ids, help="ids, e.g. 1,2,3; repeat for a batch"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="--hf: how far to run a RoPE model (a sliding-window model: at most its window)",
    )
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ids", action="store_true", help="print token ids")
    parser.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    parser.add_argument("--vocab-file", default=None)
    parser.add_argument("--merge-file", default=None)
    parser.add_argument("--tokenizer-model", default=None)
    return parser.parse_args(argv)


def tokenizer_settings(args: argparse.Namespace, saved: dict) -> dict | None:
    """The checkpoint run's tokenizer (or the HF folder's), with the flags given here; None
    when there is none."""
    data = dict(saved.get("data") or {})
    own = args.hf is not None and os.path.isfile(os.path.join(args.hf, "tokenizer_config.json"))
    if own and args.tokenizer_type is None:
        data = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": args.hf}
    for name in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model"):
        if getattr(args, name) is not None:
            data[name] = getattr(args, name)
    if not data.get("tokenizer_type"):
        return None
    keys = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")
    return {k: data.get(k) for k in keys}


def build_model(args: argparse.Namespace, tp: int, tp_group, tp_rank: int):
    layout = dict(tensor_model_parallel_size=tp, sequence_parallel=False)
    # every expert on every rank (a checkpoint may have split them over ranks)
    layout.update(expert_model_parallel_size=1, expert_tensor_parallel_size=None)
    layout.update(hidden_dropout=0.0, attention_dropout=0.0)
    if args.hf is not None:
        if args.max_position_embeddings is not None:
            layout["max_position_embeddings"] = args.max_position_embeddings
        config, model_type = hf_gpt_config(args.hf, **layout)
        (model,) = build_gpt_chunks(config, tp_group=tp_group)
        load_hf([model], args.hf, model_type, tp_rank, tp)
        return model, {}
    fields, saved, iteration = read_saved_settings(args.load, args.iteration)
    config = gpt_config_from_saved(fields, **layout)
    (model,) = build_gpt_chunks(config, tp_group=tp_group)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # another layout's RNG streams are not restored
        load_checkpoint(
            args.load,
            [model],
            groups=TrainGroups(tp=tp_group),
            iteration=iteration,
            load_optimizer=False,
            load_rng=False,
        )
    return model, saved


def prompts_and_tokenizer(args: argparse.Namespace, saved: dict, vocab_size: int):
    """The prompts as ids ``[b, s]``, checked; the tokenizer (None for ``--prompt-ids``
    without one); the end-of-document id."""
    settings = tokenizer_settings(args, saved)
    if settings is None and args.prompt is not None:
        raise ValueError("no tokenizer: give --tokenizer-type (and its files), or --prompt-ids")
    tokenizer = None if settings is None else build_tokenizer(**settings)
    flag = "--prompt" if args.prompt is not None else "--prompt-ids"
    given = args.prompt if args.prompt is not None else args.prompt_ids
    prompts = [tokenizer.tokenize(p) for p in args.prompt] if args.prompt else args.prompt_ids
    for text, ids in zip(given, prompts, strict=True):
        if not ids:
            raise ValueError(f"{flag} {text!r} has no tokens; a prompt needs at least one")
        outside = [i for i in ids if not 0 <= i < vocab_size]
        if outside:
            raise ValueError(
                f"{flag}: ids {outside} are outside the model's vocabulary [0, {vocab_size})"
            )
    if len({len(p) for p in prompts}) > 1:
        raise ValueError("prompts of a batch must have the same number of tokens")
    eod = tokenizer.eod if tokenizer is not None else None
    if eod is None and args.hf is not None:
        eos = read_hf_config(args.hf).get("eos_token_id")
        eod = eos if isinstance(eos, int) else None
    return torch.tensor(prompts, dtype=torch.long), tokenizer, eod


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
        ps.initialize_model_parallel(dist.get_world_size(), 1)
    tp_group = ps.get_tensor_model_parallel_group() if distributed else None
    tp_rank, tp = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    try:
        sampling = Sampling(
            greedy=args.temperature is None and not args.top_k and args.top_p == 1.0,
            temperature=args.temperature or 1.0,
            top_k=args.top_k,
            top_p=args.top_p,
        )
        model, saved = build_model(args, tp, tp_group, tp_rank)
        prompt, tokenizer, eod = prompts_and_tokenizer(args, saved, model.config.vocab_size)
        ids = generate(model, prompt, args.max_new_tokens, sampling, args.seed, eod=eod)
    except (OSError, ValueError, KeyError, ImportError) as error:
        exit_with_error(PROG, error)
    finally:
        if distributed:
            ps.destroy_model_parallel()
    if tp_rank == 0:
        for row in ids.tolist():
            print(row if args.ids or args.prompt_ids else tokenizer.detokenize(row))
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
