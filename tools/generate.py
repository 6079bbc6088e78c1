"""Text from a megapp checkpoint or a Hugging Face model, to see what a model learned.

    python tools/generate.py --load runs/ckpt --prompt "def main(" --max-new-tokens 64
    python tools/generate.py --hf path/to/hf_model --prompt "Once upon a time" \\
        --temperature 0.8 --top-k 50 --top-p 0.95 --seed 1
    torchrun --nproc-per-node 2 tools/generate.py --hf path/to/hf_model --prompt "..."

Greedy unless `--temperature`, `--top-k` or `--top-p` is given. Under torchrun the model
is split over the ranks by tensor parallelism (heads and vocabulary) and rank 0 prints.
The tokenizer is the checkpoint run's (`--tokenizer-*` flags override it) or, for
`--hf`, the folder's own when it has one. A key/value cache keeps generation linear in
the length. `--ids` prints token ids instead of text.
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
from megapp.models.hf_checkpoint import hf_gpt_config, load_hf
from megapp.parallel_state import TrainGroups


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", help="a megapp checkpoint directory")
    source.add_argument("--hf", help="a Hugging Face model folder")
    parser.add_argument("--iteration", type=int, default=None, help="--load's iteration")
    parser.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    parser.add_argument("--max-new-tokens", type=int, default=64)
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


def tokenizer_settings(args: argparse.Namespace, saved: dict) -> dict:
    """The checkpoint run's tokenizer (or the HF folder's), with the flags given here."""
    data = dict(saved.get("data") or {})
    own = args.hf is not None and os.path.isfile(os.path.join(args.hf, "tokenizer_config.json"))
    if own and args.tokenizer_type is None:
        data = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": args.hf}
    for name in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model"):
        if getattr(args, name) is not None:
            data[name] = getattr(args, name)
    if not data.get("tokenizer_type"):
        raise ValueError("no tokenizer: give --tokenizer-type (and its files)")
    keys = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")
    return {k: data.get(k) for k in keys}


def build_model(args: argparse.Namespace, tp: int, tp_group, tp_rank: int):
    layout = dict(tensor_model_parallel_size=tp, sequence_parallel=False)
    layout.update(hidden_dropout=0.0, attention_dropout=0.0)
    if args.hf is not None:
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
        tokenizer = build_tokenizer(**tokenizer_settings(args, saved))
        prompts = [tokenizer.tokenize(p) for p in args.prompt]
        if len({len(p) for p in prompts}) > 1:
            raise ValueError("prompts of a batch must have the same number of tokens")
        ids = generate(
            model,
            torch.tensor(prompts, dtype=torch.long),
            args.max_new_tokens,
            sampling,
            args.seed,
            eod=tokenizer.eod,
        )
    except (OSError, ValueError, KeyError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        if distributed:
            ps.destroy_model_parallel()
    if tp_rank == 0:
        for row in ids.tolist():
            print(row if args.ids else tokenizer.detokenize(row))
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
