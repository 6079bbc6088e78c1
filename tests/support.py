"""What the tests share: the tiny GPT and the single-process run every layout is held to,
the fused-op fixtures, the pipeline engine's toy blocks, gathers of sharded tensors,
hand-made pickles, and the settings of a small ``pretrain_gpt.py`` run.

Test modules import from here (``from tests.support import ...``), never from each other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import pickle
import shlex
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megapp import parallel_state as ps
from megapp.fusions.extension import cpu_ops_available
from megapp.models import GPTConfig, GPTModel
from megapp.param_attributes import (
    gather_tensor_parallel,
    is_expert_parallel,
    is_sequence_parallel,
    unshard,
)
from megapp.pipeline_parallel.catalog import schedule_kind
from megapp.planning.hardware import Hardware
from megapp.testing.pretrain_world import run_pretrain_in_world
from megapp.training import train_step
from megapp.training.arguments import config_from_flags
from megapp.training.config import PretrainConfig
from megapp.training.data_iterators import masked_token_mean, split_batch
from megapp.training.flag_groups import OptimizerArgs
from megapp.training.metrics import read_records
from megapp.training.setup import build_training_setup

ROOT = Path(__file__).resolve().parents[1]

# --- the tiny GPT, its data, and the single-process run -------------------------------------

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


# A mixture-of-experts model on top: every second layer's MLP routes each token to 2 of 4
# experts (dropless), with the load-balancing and z losses on.
MOE_CONFIG = {
    "num_moe_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 8,
    "moe_layer_freq": 2,
    "moe_aux_loss_coeff": 1e-2,
    "moe_z_loss_coeff": 1e-3,
}


def single_process(config: GPTConfig) -> GPTConfig:
    return dataclasses.replace(
        config,
        tensor_model_parallel_size=1,
        sequence_parallel=False,
        tp_comm_overlap=False,
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=None,
    )


def global_batch(
    step: int, dp: int, microbatches: int = MICROBATCHES
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """All ``microbatches × dp`` microbatches of ``step``: (tokens, labels, loss_mask)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(microbatches * dp):
        data = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
        mask = (torch.rand(MICRO_BATCH, SEQ, generator=g) > 0.25).float()
        mask[0, 0] = 1.0  # never an empty mask
        out.append((data[:, :-1], data[:, 1:], mask))
    return out


def masked_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (per_token * mask).sum() / mask.sum()


def _reference_run(
    config: GPTConfig, steps: int, dp: int, lr: float, wd: float, clip: float, microbatches: int
):
    model = GPTModel(single_process(config), seed=SEED)
    batches_per_step = microbatches * dp
    for module in model.modules():  # the auxiliary losses averaged as the main loss is
        if hasattr(module, "aux_loss_scale"):
            module.aux_loss_scale = 1.0 / batches_per_step
    decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or p.ndim == 1)]
    rest = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.ndim == 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}], lr=lr
    )
    losses, norms, first_grads = [], [], None
    for step in range(steps):
        opt.zero_grad()
        batches = global_batch(step, dp, microbatches)
        loss = sum(
            masked_mean(model(tokens, labels=labels), mask) for tokens, labels, mask in batches
        ) / len(batches)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        losses.append(float(loss.detach()))
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        for module in model.modules():  # the expert bias moves once per step, by all its tokens
            if getattr(module, "expert_bias", None) is not None:
                module.update_expert_bias()
    return model, losses, norms, first_grads


def reference_run(
    config: GPTConfig,
    steps: int,
    dp: int,
    lr: float,
    wd: float,
    clip: float,
    microbatches: int = MICROBATCHES,
):
    """The same training in one process with plain torch: AdamW, clip_grad_norm_, over
    ``microbatches`` per data-parallel rank.

    Returns (model, losses, grad_norms, first-step clipped grads by name). Called on every
    rank of a world, it runs once, on rank 0, and every rank gets rank 0's results (the
    ranks share the machine's cores: one run instead of one per rank).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return _reference_run(config, steps, dp, lr, wd, clip, microbatches)
    result = [None]
    if dist.get_rank() == 0:
        result[0] = _reference_run(config, steps, dp, lr, wd, clip, microbatches)
    dist.broadcast_object_list(result, src=0)
    return result[0]


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


# --- the tiny GPT trained under a layout, against the single-process run --------------------
#
# Three steps: the first holds every gradient, the second and third the state each step
# leaves for the next (cleared gradient buffers, Adam's moments, ZeRO's slices and gathered
# weights, the expert bias).
#
# Everything is fp32; layouts sum the same terms in other orders (tensor-parallel partial
# matmuls, microbatch and data-parallel accumulation), which moves results by a few ulps per
# op; after the Adam steps (whose update divides by sqrt(v)) that stays below 1e-4
# relative, so the tolerances are 1e-4 / 1e-6. Parameters are compared with atol 1e-4, 1/100
# of one Adam step (lr 1e-2): Adam moves every element by about lr whatever its gradient's
# size, so where a gradient is round-off or nearly cancels, a few ulps of difference in the
# gradient become up to a few 1e-5 in the parameter. A misrouted or missing gradient moves
# parameters by a whole step and still fails.

STEPS, LR, WD, CLIP = 3, 1e-2, 0.1, 0.5
GPT_TOL = dict(rtol=1e-4, atol=1e-6)
GPT_PARAM_TOL = dict(rtol=1e-4, atol=1e-4)


def layout_layers(pp: int, vpp: int | None, schedule: str | None) -> int:
    """The tiny GPT's depth under a layout: 4 layers where the pipeline has at most two
    stages (two layers per stage), 8 where it has more (so four stages of a V or of
    interleaving still hold a layer each, and uneven first and last stages fit).

    A collective's latency, not its arithmetic, is a parity case's cost on a small machine,
    so every layer a layout does not need is time."""
    chunks = max(vpp or 1, schedule_kind(schedule).min_chunks if schedule else 1)
    return 4 if pp * chunks <= 2 else 8


def layout_microbatches(pp: int) -> int:
    """Microbatches per data-parallel rank and step: 4 with a pipeline (every schedule up
    to four stages runs its warm-up, steady state and cool-down), 2 without one (where they
    are only accumulated, and two accumulate as four do)."""
    return MICROBATCHES if pp > 1 else 2


def gpt_forward_step(iterator, chunk, inputs):
    """One microbatch of :func:`global_batch` through one chunk of the tiny GPT (under
    context parallelism, this rank's slice of its sequences)."""
    tokens, labels, mask = next(iterator)
    model = chunk.module
    batch = split_batch({"tokens": tokens, "labels": labels, "mask": mask}, model.cp_group)
    kwargs = {"labels": batch["labels"]} if model.post_process else {}
    if model.pre_process:
        output = chunk(input_ids=batch["tokens"], **kwargs)
    else:
        output = chunk(hidden_states=inputs[0], **kwargs)
    return output, (lambda per_token: masked_token_mean(per_token, batch["mask"], model.cp_group))


def train_layout(
    tp,
    pp,
    vpp,
    *,
    distributed_optimizer=False,
    zero_stage=0,
    bucket_size=2000,
    schedule=None,
    strict_p2p=False,
    cp=1,
    ep=1,
    etp=None,
    overlap_grad_reduce=True,
    **config,
):
    """Train STEPS steps under the layout (and pipeline ``schedule``, a name; default 1F1B
    or interleaved; ``strict_p2p``: messages under NCCL's rules; ``cp`` context-parallel
    ranks, with ``cp_comm_type`` in ``config``; ``ep`` expert-parallel and ``etp`` expert
    tensor-parallel ranks for a model with ``num_moe_experts`` in ``config``;
    ``overlap_grad_reduce``: False reduces the gradients after the last backward; the depth
    :func:`layout_layers` unless ``config`` sets ``num_layers``); return (chunks, losses,
    grad norms, step-1 grads)."""
    config.setdefault("num_layers", layout_layers(pp, vpp, schedule))
    ps.initialize_model_parallel(
        tp,
        pp,
        vpp,
        context_parallel_size=cp,
        strict_p2p=strict_p2p,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    experts = {"expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp}
    setup = build_training_setup(
        gpt_config(
            tensor_model_parallel_size=tp,
            context_parallel_size=cp,
            **(experts if ep > 1 or etp is not None else {}),
            **config,
        ),
        OptimizerArgs(
            lr=LR, weight_decay=WD, clip_grad=CLIP, lr_decay_style="constant", lr_decay_iters=STEPS
        ),
        bucket_size=bucket_size,
        zero_stage=max(zero_stage, int(distributed_optimizer)),
        overlap_grad_reduce=overlap_grad_reduce,
        seed=SEED,
        schedule=schedule,
    )
    chunks, optimizer, groups = setup.chunks, setup.optimizer, setup.groups
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    losses, norms, first_grads = [], [], None
    for step in range(STEPS):
        batch = global_batch(step, dp, layout_microbatches(pp))
        mine = batch[dp_rank * len(batch) // dp : (dp_rank + 1) * len(batch) // dp]
        result = train_step(
            gpt_forward_step,
            [iter(mine) for _ in chunks],
            chunks,
            optimizer,
            num_microbatches=len(mine),
            groups=groups,
            schedule=schedule,
        )
        assert not result.skipped
        losses.append(result.loss)
        norms.append(result.grad_norm)
        if first_grads is None:  # under the distributed optimizer too: the slices gathered
            first_grads = _gathered(chunks, lambda c, p: c.reduced_grad(p), groups.tp)
    return chunks, losses, norms, first_grads


def _gathered(chunks, what, tp_group) -> dict[str, torch.Tensor]:
    out = {}
    for chunk in chunks:
        model = chunk.module
        for name, p in model.named_parameters():
            ref = reference_name(model, name)
            vocab = VOCAB if ref in ("embedding.word_embeddings.weight", "output_weight") else None
            if is_expert_parallel(p):
                out[ref] = _whole_experts(what(chunk, p).detach().clone(), p)
                continue
            out[ref] = full_tensor(what(chunk, p).detach().clone(), p, tp_group, vocab)
    return out


def _whole_experts(t: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """Every expert of ``t`` (an expert parameter, or its gradient): the expert
    tensor-parallel shards joined, then the expert-parallel ranks' experts stacked."""
    full = gather_tensor_parallel(t, param, ps.get_expert_tensor_parallel_group())
    ep_group = ps.get_expert_model_parallel_group()
    if ep_group is None:
        return full
    return gather(full, ep_group, dim=0)


def check_against_reference(chunks, losses, norms, first_grads, config_kw):
    """:func:`train_layout`'s results against :func:`reference_run` of the same model: every
    step's loss and gradient norm, step 1's gradients, and the parameters at the end."""
    dp = ps.get_data_parallel_world_size()
    layout = ("sequence_parallel", "tp_comm_overlap", "cp_comm_type")
    single = {k: v for k, v in config_kw.items() if k not in layout}
    single["num_layers"] = chunks[0].module.config.num_layers  # train_layout's choice
    microbatches = layout_microbatches(ps.get_pipeline_model_parallel_world_size())
    reference, ref_losses, ref_norms, ref_grads = reference_run(
        gpt_config(**single), STEPS, dp, LR, WD, CLIP, microbatches
    )
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **GPT_TOL)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), **GPT_TOL)
    if first_grads is not None:
        for name, grad in first_grads.items():
            torch.testing.assert_close(
                grad, ref_grads[name], **GPT_TOL, msg=lambda m, n=name: f"grad of {n}: {m}"
            )
    ref_params = dict(reference.named_parameters())
    with contextlib.ExitStack() as stack:  # ZeRO-3 keeps slices: see the weights whole
        for chunk in chunks:
            stack.enter_context(chunk.full_weights())
        params = _gathered(chunks, lambda c, p: p.data, ps.get_tensor_model_parallel_group())
    for name, value in params.items():
        torch.testing.assert_close(
            value, ref_params[name].detach(), **GPT_PARAM_TOL, msg=lambda m, n=name: f"{n}: {m}"
        )


# --- the pipeline engine's toy model: float64 residual blocks -------------------------------


class Block(nn.Module):
    """x + tanh(W x + b): the residual add makes the output droppable after sending."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden, dtype=torch.float64)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


def block_reference_loss(layers: nn.ModuleList, batches) -> torch.Tensor:
    """The mean MSE of ``batches`` ((x, target) pairs) through ``layers`` in one process,
    with its backward run (the gradients land in ``layers``)."""
    losses = []
    for x, target in batches:
        for layer in layers:
            x = layer(x)
        losses.append(nn.functional.mse_loss(x, target))
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.detach()


def block_forward_step(iterator, chunk, inputs):
    """One (x, target) microbatch through a chunk of blocks, with the MSE loss."""
    x, target = next(iterator)
    h = x if inputs is None else inputs[0]
    for layer in chunk:
        h = layer(h)
    return h, lambda out: nn.functional.mse_loss(out, target)


# --- whole tensors from tensor-parallel parts -----------------------------------------------


def gather(t: torch.Tensor, group, dim: int, stride: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's part along ``dim``."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return unshard(parts, dim, stride)


def full_grad(param: torch.nn.Parameter, group) -> torch.Tensor:
    """The gradient of the whole parameter, however it is split or replicated."""
    if group is None:
        return param.grad
    grad = gather_tensor_parallel(param.grad, param, group)
    if is_sequence_parallel(param):  # each rank saw only its sequence shard
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
    return grad


# --- fused ops: the C++ extension and the dispatch switch -----------------------------------

# A missing build is a defect: kernel tests fail unless the install was deliberately pure-Python.
requires_cpu_ext = pytest.mark.skipif(
    os.environ.get("MEGAPP_BUILD_CPU_EXT") == "0",
    reason="MEGAPP_BUILD_CPU_EXT=0: installed without the C++ extension",
)


@pytest.fixture
def ops():
    assert cpu_ops_available(), (
        "megapp._C is not built or failed to load: run `pip install --no-build-isolation -e .` "
        "(set MEGAPP_BUILD_CPU_EXT=0 to test a pure-Python install)"
    )
    return torch.ops.megapp


@pytest.fixture(autouse=True)
def fused_unset(monkeypatch):
    """Imported by a module, for all its tests: MEGAPP_FUSED unset (tests set it themselves;
    an exported value must not change what they check)."""
    monkeypatch.delenv("MEGAPP_FUSED", raising=False)


def grad_bias_tol(tol, rows):
    # grad_bias sums `rows` terms in a different order than torch.sum: allow ~rows·eps·|terms|.
    return {"rtol": tol["rtol"], "atol": tol["atol"] * max(1, rows) * 10}


# --- hand-made pickles: globals by any name, in any protocol --------------------------------


def pickle_text(value: str, protocol: int) -> bytes:
    if protocol >= 4:
        data = value.encode()
        return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data
    return pickle.UNICODE + value.encode("raw-unicode-escape") + b"\n"


def pickle_global(module: str, name: str, protocol: int) -> bytes:
    if protocol >= 4:  # protocol 4 resolves dotted names through STACK_GLOBAL
        return pickle_text(module, protocol) + pickle_text(name, protocol) + pickle.STACK_GLOBAL
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def pickle_call(func: bytes, args: list[bytes]) -> bytes:
    return func + pickle.MARK + b"".join(args) + pickle.TUPLE + pickle.REDUCE


def pickle_of(body: bytes, protocol: int) -> bytes:
    head = pickle.PROTO + bytes([protocol]) if protocol >= 2 else b""
    return head + body + pickle.STOP


def dotted_system_payload(marker: Path, protocol: int) -> bytes:
    """A pickle that, loaded by plain ``pickle.loads``, runs ``touch marker``."""
    # torch.distributed.checkpoint.metadata imports os: "os.system" is reachable through it
    system = pickle_global("torch.distributed.checkpoint.metadata", "os.system", protocol)
    return pickle_of(pickle_call(system, [pickle_text(f"touch {marker}", protocol)]), protocol)


# --- Hugging Face folders -------------------------------------------------------------------


def hf_tensors(directory) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's safetensors files, by name."""
    import safetensors.torch

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(safetensors.torch.load_file(os.path.join(directory, name)))
    return out


# --- Hugging Face round trips through pretrain_gpt.py and the checkpoint tools -------

HF_RUN = [
    *("--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4"),
    *("--lr", "0", "--min-lr", "0", "--train-iters", "1", "--eval-iters", "0"),
    "--log-interval",
    "1",
]
"""One step at learning rate 0: the weights stay what they were."""


def tool_main(capsys, tool: str, *args) -> tuple[int, str, list[str]]:
    """``tools/checkpoint/<tool>.py args`` run in this process: (exit status, stdout,
    stderr lines)."""
    module = importlib.import_module(f"tools.checkpoint.{tool}")
    capsys.readouterr()  # what ran before is not the tool's
    try:
        status = module.main([str(a) for a in args])
    except SystemExit as stop:
        status = stop.code
    out, err = capsys.readouterr()
    return status, out, err.strip().splitlines()


def assert_same_model(exported, original):
    """The same tensors, bitwise, the same config files, and the usual file mode."""
    ours, theirs = hf_tensors(exported), hf_tensors(original)
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    for name in ("config.json", "generation_config.json"):
        assert read_json(exported / name) == read_json(original / name), name
    mask = os.umask(0)
    os.umask(mask)
    for path in exported.iterdir():
        assert path.stat().st_mode & 0o777 == 0o666 & ~mask, path.name


def read_json(path):
    return json.loads(path.read_text())


def convert_tool(capsys, *args):
    """tools/checkpoint/convert_hf.py run in this process: (exit status, stderr lines)."""
    status, _, err = tool_main(capsys, "convert_hf", *args)
    return status, err


# --- the planner's hardware with round numbers ----------------------------------------------

# Round numbers, no fixed overheads, no overlap: every second is traceable by hand.
PLAIN_HARDWARE = Hardware(
    name="plain",
    gemm_flops=1e12,
    peak_flops=2e12,
    memory_bytes=80e9,
    memory_bandwidth=1e12,
    gpus_per_node=8,
    intra_node_bandwidth=100e9,
    intra_node_latency=1e-6,
    inter_node_bandwidth=10e9,
    inter_node_latency=5e-6,
    overlap_communication=False,
)
# gloo: a send finishes in the background, without waiting for its receive
GLOO_HARDWARE = dataclasses.replace(PLAIN_HARDWARE, transport="gloo")


# --- pretrain_gpt.py's settings ----------------------------------------------------------------

PRETRAIN_BASE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --lr 1e-3 --train-iters 10 --use-default-corpus"
)


def args_for(extra: str = "", world_size: int = 8, base: str = PRETRAIN_BASE) -> PretrainConfig:
    """The checked config of ``base`` plus ``extra`` flags for a job of ``world_size``."""
    return config_from_flags(shlex.split(f"{base} {extra}"), world_size)


# --- checkpoints saved by pretrain_gpt.py jobs, for resuming under other layouts ----------


def train_records(path) -> dict[int, dict]:
    """A metrics file's training records by iteration."""
    return {r["iteration"]: r for r in read_records(path, "train")}


def data_flags(corpus, root) -> list[str]:
    """The test corpus, with its index cache under ``root``."""
    return ["--data-path", str(corpus / "stdlib"), "--data-cache-path", str(root / "cache")]


def checkpoint_sources(sources, model, save_at, corpus, tmp_path_factory):
    """Each source job (name -> (ranks, layout flags)) of ``model`` run whole, saving every
    ``save_at`` iterations: name -> (its directory, its training records by iteration)."""
    out = {}
    for name, (nproc, layout) in sources.items():
        root = tmp_path_factory.mktemp(name.replace(" ", "_"))
        job = run_pretrain_in_world(
            nproc,
            [
                *model,
                *layout.split(),
                *data_flags(corpus, root),
                *("--save", str(root / "ckpt"), "--save-interval", str(save_at)),
                *("--metrics-path", str(root / "metrics.jsonl")),
            ],
            cwd=root,
        )
        assert job.returncode == 0, job.stderr[-4000:]
        out[name] = (root, train_records(root / "metrics.jsonl"))
    return out
