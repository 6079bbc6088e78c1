"""Global gradient norm and clipping under real model-parallel layouts.

A small tied-embedding model is run once per process to get its full fp32 gradients. Each
rank then holds the pieces a (tp, pp, dp) layout would give it: vocab- and column-parallel
shards, a row-parallel weight split along its input, replicated biases and norm weights,
and, on the last pipeline stage, the tied output embedding marked ``shared``. The norm over
the ranks must equal ``torch.nn.utils.get_total_norm`` of the full gradients, and clipping
must match ``torch.nn.utils.clip_grad_norm_``. Only the order of fp32 additions differs, so
1e-6 relative is far above round-off and far below any element counted twice or missed.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megapp import parallel_state as ps
from megapp.optimizer import (
    clip_grad_by_total_norm_,
    clip_grad_norm_,
    get_grad_norm,
    grads_for_norm,
)
from megapp.testing import distributed

RTOL = 1e-6
VOCAB, HIDDEN, FFN, TOKENS = 16, 8, 12, 10

# name -> (shape, dim split over tp or None for replicated, pipeline stage under pp=2)
LAYOUT = {
    "embedding": ((VOCAB, HIDDEN), 0, 0),
    **{
        f"layers.{l}.{name}": (shape, split, l)
        for l in range(2)
        for name, (shape, split) in {
            "norm.weight": ((HIDDEN,), None),
            "fc1.weight": ((FFN, HIDDEN), 0),  # column parallel
            "fc1.bias": ((FFN,), 0),
            "fc2.weight": ((HIDDEN, FFN), 1),  # row parallel
            "fc2.bias": ((HIDDEN,), None),
        }.items()
    },
    "final_norm.weight": ((HIDDEN,), None, 1),
}


def _full_grads() -> dict[str, torch.Tensor]:
    """Gradients of every parameter of the single-process model (output tied to input)."""
    generator = torch.Generator().manual_seed(0)
    params = {
        name: torch.randn(shape, generator=generator).requires_grad_()
        for name, (shape, _, _) in LAYOUT.items()
    }
    tokens = torch.randint(VOCAB, (TOKENS,), generator=generator)
    x = params["embedding"][tokens]
    for l in range(2):
        layer = {name[len(f"layers.{l}.") :]: p for name, p in params.items() if f".{l}." in name}
        h = F.rms_norm(x, (HIDDEN,), layer["norm.weight"])
        h = F.gelu(F.linear(h, layer["fc1.weight"], layer["fc1.bias"]))
        x = x + F.linear(h, layer["fc2.weight"], layer["fc2.bias"])
    x = F.rms_norm(x, (HIDDEN,), params["final_norm.weight"])
    logits = x @ params["embedding"].t()
    F.cross_entropy(logits, torch.roll(tokens, -1)).backward()
    return {name: param.grad for name, param in params.items()}


def _piece(full: torch.Tensor, split: int | None, tp: int, tp_rank: int) -> torch.Tensor:
    return full if split is None else full.chunk(tp, split)[tp_rank]


def _local_params(full_grads, tp: int, pp: int, tp_rank: int, pp_rank: int) -> dict:
    """The parameters (with ``.grad``) this rank holds, keyed by the full model's names."""
    local = {}
    for name, (_, split, stage) in LAYOUT.items():
        if pp == 1 or stage == pp_rank:
            local[name] = (_piece(full_grads[name], split, tp, tp_rank), split)
    if pp > 1 and pp_rank == pp - 1:
        # Tied output embedding: a copy of the embedding's (already summed) gradient.
        local["output"] = (_piece(full_grads["embedding"], 0, tp, tp_rank), 0)
    params = {}
    for name, (grad, split) in local.items():
        param = torch.nn.Parameter(torch.zeros_like(grad))
        param.grad = grad.clone()
        param.tensor_model_parallel = split is not None
        if name == "output":
            param.shared = True
        params[name] = param
    return params


LAYOUTS = [  # (world_size, tp, pp)
    (2, 2, 1),
    (2, 1, 2),
    # fast: the two-rank layouts (tp 2, pp 2); the four-rank ones are slow
    pytest.param(4, 2, 2, marks=pytest.mark.slow),  # model-parallel group = the whole world
    # dp = 2: each replica's model-parallel group gives the full norm
    pytest.param(4, 2, 1, marks=pytest.mark.slow),
    pytest.param(4, 4, 1, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 3.0])
@pytest.mark.parametrize("world_size, tp, pp", LAYOUTS)
@distributed()
def test_grad_norm_and_clipping_match_single_process(world_size, tp, pp, norm_type):
    ps.initialize_model_parallel(tp, pp)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    group = ps.get_model_parallel_group()
    full_grads = _full_grads()
    params = _local_params(full_grads, tp, pp, tp_rank, pp_rank)

    expected = torch.nn.utils.get_total_norm(list(full_grads.values()), norm_type).item()
    norm = get_grad_norm(grads_for_norm(params.values(), tp_rank), norm_type, group)
    assert norm == pytest.approx(expected, rel=RTOL)

    max_norm = 0.25 * expected
    reference = {name: torch.nn.Parameter(torch.zeros_like(g)) for name, g in full_grads.items()}
    for name, param in reference.items():
        param.grad = full_grads[name].clone()
    torch.nn.utils.clip_grad_norm_(reference.values(), max_norm, norm_type)
    measured = clip_grad_norm_(
        params.values(), max_norm, tp_rank=tp_rank, norm_type=norm_type, group=group
    )
    assert measured == pytest.approx(expected, rel=RTOL)
    for name, param in params.items():
        split = 0 if name == "output" else LAYOUT[name][1]
        full = reference["embedding" if name == "output" else name].grad
        expected_piece = _piece(full, split, tp, tp_rank)
        torch.testing.assert_close(param.grad, expected_piece, rtol=RTOL, atol=0.0, msg=name)


def test_grads_for_norm_selects_each_gradient_once():
    def param(*, tp=None, shared=None, grad=True, main_grad=False):
        p = torch.nn.Parameter(torch.zeros(2))
        if grad:
            p.grad = torch.ones(2)
        if main_grad:
            p.main_grad = torch.full((2,), 3.0)
        if tp is not None:
            p.tensor_model_parallel = tp
        if shared is not None:
            p.shared = shared
        return p

    sharded, replicated = param(tp=True), param(tp=False)
    unmarked, tied_copy = param(), param(tp=True, shared=True)
    not_shared, no_grad = param(tp=True, shared=False), param(tp=True, grad=False)
    with_main = param(tp=True, main_grad=True)
    params = [sharded, replicated, unmarked, tied_copy, not_shared, no_grad, with_main]
    ids = lambda grads: [id(g) for g in grads]  # noqa: E731
    rank0 = [sharded.grad, replicated.grad, unmarked.grad, not_shared.grad, with_main.main_grad]
    assert ids(grads_for_norm(params, tp_rank=0)) == ids(rank0)
    rank1 = [sharded.grad, not_shared.grad, with_main.main_grad]
    assert ids(grads_for_norm(params, tp_rank=1)) == ids(rank1)


def test_norm_of_bf16_grads_is_accumulated_in_fp32():
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(4096, generator=generator).bfloat16() for _ in range(3)]
    expected = torch.cat([g.double() for g in grads]).norm().item()
    assert get_grad_norm(grads) == pytest.approx(expected, rel=RTOL)
    assert get_grad_norm([]) == 0.0


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_by_total_norm_matches_torch(max_norm):
    generator = torch.Generator().manual_seed(2)
    grads = [torch.randn(shape, generator=generator) for shape in [(5, 3), (7,), (2, 2, 2)]]
    reference = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(reference, grads, strict=True):
        param.grad = grad.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference, max_norm).item()
    total_norm = get_grad_norm(grads)
    assert total_norm == pytest.approx(expected_norm, rel=RTOL)
    coeff = clip_grad_by_total_norm_(grads, max_norm, total_norm)
    assert coeff == (max_norm / (total_norm + 1e-6) if max_norm < total_norm else 1.0)
    for grad, param in zip(grads, reference, strict=True):
        torch.testing.assert_close(grad, param.grad, rtol=RTOL, atol=0.0)


def test_bad_norm_type_raises():
    with pytest.raises(ValueError, match="norm_type must be > 0"):
        get_grad_norm([torch.ones(2)], norm_type=0.0)
