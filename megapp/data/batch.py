"""From a batch of token windows to model inputs: tokens, labels, loss mask, position ids."""

from __future__ import annotations

from typing import Any

import torch


def get_ltor_masks_and_position_ids(
    data: torch.Tensor,
    eod_token: int,
    eod_mask_loss: bool = False,
    reset_position_ids: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss mask and position ids for left-to-right training on `data` `[b, s]`.

    Args:
        data: input tokens `[b, s]`.
        eod_token: the end-of-document id.
        eod_mask_loss: zero the loss where the input is EOD, i.e. do not train the
            prediction of a new document's first token from the previous document.
        reset_position_ids: restart positions at 0 after every EOD, so each packed
            document sees the positions it would see alone.

    Returns:
        loss_mask float32 `[b, s]` and position_ids int64 `[b, s]`.
    """
    batch, length = data.shape
    loss_mask = torch.ones(batch, length, dtype=torch.float32, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    positions = torch.arange(length, dtype=torch.long, device=data.device).expand(batch, length)
    if not reset_position_ids:
        return loss_mask, positions.contiguous()
    # A document starts at 0 and after every EOD; each position counts from the
    # latest start at or before it (a running maximum of the start positions).
    starts = torch.zeros_like(positions)
    starts[:, 1:] = torch.where(data[:, :-1] == eod_token, positions[:, 1:], 0)
    latest_start = torch.cummax(starts, dim=1).values
    return loss_mask, positions - latest_start


def get_batch(
    batch: dict[str, Any],
    eod_token: int,
    eod_mask_loss: bool = False,
    reset_position_ids: bool = False,
) -> dict[str, torch.Tensor]:
    """Split collated windows `{"tokens": [b, s + 1]}` into the model's inputs and targets.

    Returns:
        tokens `[b, s]` (positions 0..s-1), labels `[b, s]` (positions 1..s),
        loss_mask float32 `[b, s]`, position_ids int64 `[b, s]`.
    """
    windows = torch.as_tensor(batch["tokens"]).long()
    tokens = windows[:, :-1].contiguous()
    labels = windows[:, 1:].contiguous()
    loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod_token, eod_mask_loss, reset_position_ids
    )
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
    }
