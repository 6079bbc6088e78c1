"""What the training loop reports: Megatron-style log lines, a JSON-lines file, TensorBoard.

One :class:`MetricsWriter` lives on the last rank (the rank that holds the
loss in Megatron's layout). Every record goes to the JSON-lines file, one
object per line with a ``"kind"`` of ``"train"`` (one per log interval),
``"eval"`` (one per evaluation) or ``"run"`` (the start of a run), and, when a
TensorBoard directory is given, to TensorBoard as scalars.

Throughput counts model FLOPs (:mod:`megapp.training.flops`), not the extra
forward of activation recompute, so it compares across recompute settings.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from megapp.training.flops import peak_16bit_tflops


def peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak for ``dtype`` when known (16-bit on the GPUs of
    :data:`megapp.training.flops.GPU_PEAKS`), else None."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    return peak_16bit_tflops(torch.cuda.get_device_name(device))


def perplexity(loss: float) -> float:
    """``exp(loss)``, capped at ``exp(20)`` so an early, large loss stays printable."""
    return math.exp(min(20.0, loss))


def _tflops(value: float) -> str:
    # One decimal as Megatron prints it; small (CPU) figures keep four so they do not read 0.0.
    return f"{value:.1f}" if value >= 1.0 else f"{value:.4f}"


def format_train_line(record: Mapping[str, Any], train_iters: int) -> str:
    """Megatron's per-interval line from a ``"train"`` record."""
    parts = [
        f" iteration {record['iteration']:8d}/{train_iters:8d}",
        f" consumed samples: {record['consumed_samples']:12d}",
        f" elapsed time per iteration (ms): {record['elapsed_ms_per_iteration']:.1f}",
        f" throughput per GPU (TFLOP/s/GPU): {_tflops(record['tflops_per_device'])}",
    ]
    if record.get("mfu") is not None:
        parts.append(f" MFU: {100 * record['mfu']:.1f}%")
    parts += [
        f" tokens per second: {record['tokens_per_second_per_device']:.1f}",
        f" learning rate: {record['learning_rate']:.6E}",
        f" global batch size: {record['global_batch_size']:5d}",
    ]
    if record.get("lm_loss") is not None:
        parts.append(f" lm loss: {record['lm_loss']:.6E}")
    parts += [
        f" loss scale: {record['loss_scale']:.1f}",
        f" grad norm: {record['grad_norm']:.3f}" if record.get("grad_norm") is not None else None,
        f" number of skipped iterations: {record['skipped_iterations']:3d}",
        f" number of nan iterations: {record['nan_iterations']:3d}",
    ]
    return " |".join(p for p in parts if p is not None) + " |"


def format_eval_lines(record: Mapping[str, Any]) -> str:
    """Megatron's evaluation block: the losses between two rules as long as the line."""
    name = "validation" if record["split"] == "valid" else record["split"]
    line = (
        f" {name} loss at {record['where']} | lm loss value: "
        f"{record['lm_loss']:.6E} | lm loss PPL: {record['lm_loss_ppl']:.6E} | "
    )
    rule = "-" * (len(line) + 1)
    return f"{rule}\n{line}\n{rule}"


class MetricsWriter:
    """Appends records to a JSON-lines file and, optionally, TensorBoard.

    Args:
        path: the JSON-lines file (its directory is created); appended to, so a
            resumed run continues the same file.
        tensorboard_dir: a TensorBoard log directory, or None.
    """

    def __init__(self, path: str, tensorboard_dir: str | None = None) -> None:
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._tensorboard = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=tensorboard_dir, max_queue=1000)

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record``; non-finite numbers (a skipped step's grad norm) become null,
        so every line is strict JSON."""
        finite = {
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in record.items()
        }
        self._file.write(json.dumps(finite, allow_nan=False) + "\n")
        self._file.flush()
        if self._tensorboard is None or "iteration" not in record:
            return
        step = record["iteration"]
        if record["kind"] == "train":
            for key, name in (
                ("lm_loss", "lm loss"),
                ("learning_rate", "learning-rate"),
                ("grad_norm", "grad-norm"),
                ("loss_scale", "loss-scale"),
                ("global_batch_size", "batch-size"),
                ("tflops_per_device", "throughput"),
            ):
                if finite.get(key) is not None:
                    self._tensorboard.add_scalar(name, finite[key], step)
        elif record["kind"] == "eval":
            suffix = "" if record["split"] == "valid" else f" {record['split']}"
            self._tensorboard.add_scalar(f"lm loss validation{suffix}", record["lm_loss"], step)
            self._tensorboard.add_scalar(
                f"lm loss validation ppl{suffix}", record["lm_loss_ppl"], step
            )

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def read_records(
    path: str | os.PathLike, kind: str | None = None, *, last_run: bool = False
) -> list[dict[str, Any]]:
    """The records of a JSON-lines metrics file, in order.

    Args:
        path: the file :class:`MetricsWriter` appended to.
        kind: keep only records of this ``"kind"`` (``"train"``, ``"eval"``, ``"run"``,
            ``"profile"``); None keeps all.
        last_run: keep only what the last run wrote (from its ``"run"`` record on), for a
            file that several launches appended to.

    A torn last line (a run killed while writing) is skipped; a bad line elsewhere raises
    ``ValueError`` naming the file and the line.
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a metrics record ({error})") from None
    if last_run:
        starts = [i for i, r in enumerate(records) if r.get("kind") == "run"]
        records = records[starts[-1] :] if starts else records
    return records if kind is None else [r for r in records if r.get("kind") == kind]
