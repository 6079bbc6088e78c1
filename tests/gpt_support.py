"""A tiny GPT, its data, and the single-process training run every layout is held to."""

from __future__ import annotations

import dataclasses

import torch

from megapp.models import GPTConfig, GPTModel
from megapp.param_attributes import gather_tensor_parallel

VOCAB, SEQ, MICRO_BATCH, MICROBATCHES, SEED = 37, 8, 2, 4, 1234


def gpt_config(**overrides) -> GPTConfig:
    base = dict(
        num_layers=8,
        hidden_size=16,
        num_attention_heads=4,
        vocab_size=VOCAB,  # 37 does not divide by tp: exercises the padded vocabulary
        max_position_embeddings=SEQ,
        hidden_dropout=0.0,  # dropout masks differ between layouts by design
        attention_dropout=0.0,
    )
    base.update(overrides)
    return GPTConfig(**base)


def single_process(config: GPTConfig) -> GPTConfig:
    return dataclasses.replace(config, tensor_model_parallel_size=1, sequence_parallel=False)


def global_batch(step: int, dp: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """All ``MICROBATCHES × dp`` microbatches of ``step``: (tokens, labels, loss_mask)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(MICROBATCHES * dp):
        data = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
        mask = (torch.rand(MICRO_BATCH, SEQ, generator=g) > 0.25).float()
        mask[0, 0] = 1.0  # never an empty mask
        out.append((data[:, :-1], data[:, 1:], mask))
    return out


def masked_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (per_token * mask).sum() / mask.sum()


def reference_run(config: GPTConfig, steps: int, dp: int, lr: float, wd: float, clip: float):
    """The same training in one process with plain torch: AdamW, clip_grad_norm_.

    Returns (model, losses, grad_norms, first-step clipped grads by name).
    """
    model = GPTModel(single_process(config), seed=SEED)
    decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or p.ndim == 1)]
    rest = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.ndim == 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}], lr=lr
    )
    losses, norms, first_grads = [], [], None
    for step in range(steps):
        opt.zero_grad()
        batches = global_batch(step, dp)
        loss = sum(
            masked_mean(model(tokens, labels=labels), mask) for tokens, labels, mask in batches
        ) / len(batches)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        losses.append(float(loss.detach()))
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return model, losses, norms, first_grads


def reference_name(chunk: GPTModel, name: str) -> str:
    """The single-process model's name for ``chunk``'s parameter ``name``."""
    parts = name.split(".")
    if parts[0] == "decoder" and parts[1] == "layers":
        parts[2] = str(chunk.decoder.layers[int(parts[2])].layer_number)
    if parts[0] == "output_weight" and chunk.config.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    return ".".join(parts)


def full_tensor(
    t: torch.Tensor, param: torch.nn.Parameter, tp_group, vocab: int | None = None
) -> torch.Tensor:
    """The whole tensor ``t`` (the parameter or its gradient) from every tp rank's part;
    ``vocab``: keep that many rows (drop the vocabulary padding)."""
    full = gather_tensor_parallel(t, param, tp_group)
    return full if vocab is None else full[:vocab]
