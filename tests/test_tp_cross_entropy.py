"""vocab_parallel_cross_entropy on 1, 2 and 4 tensor-parallel ranks against
torch.nn.functional.cross_entropy on the full, unpadded logits of one process.

Every rank builds the same full logits from one seed, takes its shard of the padded vocabulary,
and compares the loss and the gradient gathered from all shards with the single-process
expression. Padded columns hold large garbage, so any leak of them into the softmax shows.
The shards run through the fused CPU kernels (megapp.tensor_parallel.cross_entropy); one test
repeats the layouts on the pure-PyTorch reference tier (MEGAPP_FUSED=0).
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapp import parallel_state as ps
from megapp.fusions import extension
from megapp.tensor_parallel import pad_vocab_size, vocab_parallel_cross_entropy, vocab_range
from megapp.testing import distributed

S, B = 3, 2  # [s, b]: small, the worlds are shared and every case should take milliseconds
SMOOTHING = 0.1
# (world_size, tp): tp 1 on a real world, and tp 2 beside data parallelism on 4 ranks.
# fast: tp 2 on two ranks; the others are slow
LAYOUTS = [
    pytest.param(2, 1, marks=pytest.mark.slow),
    (2, 2),
    pytest.param(4, 2, marks=pytest.mark.slow),
    pytest.param(4, 4, marks=pytest.mark.slow),
]
# (real vocabulary, pad multiple): padding inside the last shard; whole shards of padding
# (37 → 256 or 512 ids); GPT-2's 50257 → 50432 (tp 2) or 50688 (tp 4), not divisible by tp.
VOCABS = [(37, 1), (37, 128), (50257, 128)]
DTYPES = [torch.float32, torch.bfloat16]

# The reference runs in float64, so these bound our float32 round-off alone: the float32 sums
# over up to 50k ids (max, Σexp, Σz) give a few 1e-7 relative on the loss and ~1e-7 absolute
# on each gradient entry (measured: 1.2e-6 on losses of ~25, 5e-8 on gradients).
# torch's own float32 cross entropy is further off (1e-4 on some gradient entries at 50k ids).
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
# bf16 gradients: the float32 gradient rounded once to bf16 (8-bit significand), so at most
# half a bf16 ulp (2^-8 relative) from the reference, plus the float32 error above.
BF16_GRAD_TOL = dict(rtol=2**-8, atol=1e-6)
# The tier the loss must have run: the CPU kernels, unless the install deliberately has none or
# the environment forces the reference.
FUSED_TIER = (
    "reference"
    if "0" in (os.environ.get("MEGAPP_BUILD_CPU_EXT"), os.environ.get("MEGAPP_FUSED"))
    else "cpu"
)


def _inputs(vocab: int, padded: int, dtype: torch.dtype, seed: int = 0):
    """Full logits ``[S, B, padded]`` (same on every rank), targets ``[S, B]``, loss weights."""
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(S, B, padded, generator=gen) * 4
    full[..., vocab:] = 1e4  # garbage that would dominate the softmax if it leaked
    target = torch.randint(0, vocab, (S, B), generator=gen)
    target[0, 0], target[-1, -1] = vocab - 1, 0  # both ends of the real vocabulary
    grad_out = torch.rand(S, B, generator=gen) + 0.5  # non-uniform weights per token
    return full.to(dtype), target, grad_out


def _reference(full: torch.Tensor, target: torch.Tensor, vocab: int, smoothing: float, grad_out):
    """Single-process float64 loss and logits gradient on the unpadded logits.

    Megatron's smoothing ``s`` keeps ``1 − s`` on the target; torch's ``label_smoothing=ε``
    keeps ``1 − ε + ε/K``: they agree for ``ε = s·K/(K−1)``.
    """
    logits = full[..., :vocab].double().requires_grad_()
    loss = F.cross_entropy(
        logits.reshape(-1, vocab),
        target.reshape(-1),
        reduction="none",
        label_smoothing=smoothing * vocab / (vocab - 1),
    ).view(target.shape)
    loss.backward(grad_out.double())
    return loss.detach(), logits.grad


def _all_gather(x: torch.Tensor, group, world: int) -> list[torch.Tensor]:
    if world == 1:
        return [x]
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def _check(
    vocab, multiple, smoothing, dtype, group, world, rank, use_default_vocab=False, tier=FUSED_TIER
):
    padded = pad_vocab_size(vocab, world, multiple)
    start, end = vocab_range(padded, rank, world)
    full, target, grad_out = _inputs(vocab, padded, dtype)
    # A strided view of the full logits, as a sliced output would be.
    shard = full[..., start:end].detach().requires_grad_()
    loss = vocab_parallel_cross_entropy(
        shard, target, smoothing, group, vocab_size=None if use_default_vocab else vocab
    )
    assert loss.grad_fn.tier == tier  # the Function's ctx: the tier its forward ran
    loss.backward(grad_out)
    assert loss.dtype == torch.float32 and loss.shape == (S, B)
    assert shard.grad.dtype == dtype and shard.grad.shape == shard.shape

    ref_loss, ref_grad = _reference(full, target, vocab, smoothing, grad_out)
    torch.testing.assert_close(loss.detach().double(), ref_loss, **FP32_TOL)
    grad = torch.cat(_all_gather(shard.grad.float(), group, world), dim=-1)  # exact for bf16
    grad_tol = FP32_TOL if dtype == torch.float32 else BF16_GRAD_TOL
    torch.testing.assert_close(grad[..., :vocab].double(), ref_grad, **grad_tol)
    assert torch.equal(grad[..., vocab:], torch.zeros_like(grad[..., vocab:])), "padding grad"
    # The loss comes from all-reduced sums, so every TP rank holds the very same bits.
    assert all(torch.equal(other, loss) for other in _all_gather(loss.detach(), group, world))


# fast: float32; bfloat16 is slow
@pytest.mark.parametrize(
    "dtype",
    [DTYPES[0], *(pytest.param(d, marks=pytest.mark.slow) for d in DTYPES[1:])],
    ids=lambda d: str(d).removeprefix("torch."),
)
@pytest.mark.parametrize("smoothing", [0.0, SMOOTHING])
@pytest.mark.parametrize("vocab, multiple", VOCABS)
@pytest.mark.parametrize("world_size, tp", LAYOUTS)
@distributed()
def test_matches_single_process_cross_entropy(world_size, tp, vocab, multiple, smoothing, dtype):
    ps.initialize_model_parallel(tp)
    group = ps.get_tensor_model_parallel_group()
    _check(vocab, multiple, smoothing, dtype, group, tp, ps.get_tensor_model_parallel_rank())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("world_size, tp", [(2, 2), pytest.param(4, 4, marks=pytest.mark.slow)])
@distributed()
def test_reference_tier_matches_single_process_cross_entropy(world_size, tp, dtype):
    ps.initialize_model_parallel(tp)
    group, rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    with extension.fused(False):
        for vocab, multiple in [(37, 128), (50257, 128)]:
            _check(vocab, multiple, SMOOTHING, dtype, group, tp, rank, tier="reference")


@pytest.mark.parametrize("smoothing", [0.0, SMOOTHING])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_tp1_without_torch_distributed(dtype, smoothing):
    assert not dist.is_initialized()  # this is the pytest process, not a world's worker
    _check(37, 128, smoothing, dtype, group=None, world=1, rank=0)
    _check(40, 1, smoothing, dtype, group=None, world=1, rank=0, use_default_vocab=True)


@distributed(world_size=2)
def test_no_group_means_no_tensor_parallelism_inside_a_world():
    # tp_group=None is one unsharded rank even when torch.distributed is initialized.
    _check(40, 1, SMOOTHING, torch.float32, None, world=1, rank=0, use_default_vocab=True)


def test_any_leading_shape_and_input_untouched():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 7, generator=gen)  # [tokens, V]: no batch dimension
    before = logits.clone()
    target = torch.tensor([0, 5, 3, 3, 1])
    leaf = logits.requires_grad_()
    loss = vocab_parallel_cross_entropy(leaf, target, vocab_size=6)
    ref = F.cross_entropy(logits.detach()[:, :6], target, reduction="none")
    torch.testing.assert_close(loss, ref, **FP32_TOL)
    assert torch.equal(logits.detach(), before)  # computed in its own buffer


@pytest.mark.parametrize("world_size, tp", [(2, 2), (4, 4)])
@distributed()
def test_out_of_range_target_raises_on_every_rank(world_size, tp):
    ps.initialize_model_parallel(tp)
    group, rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    vocab = 37
    padded = pad_vocab_size(vocab, tp, multiple=1)  # 38 (tp 2) or 40 (tp 4)
    start, end = vocab_range(padded, rank, tp)
    full, target, _ = _inputs(vocab, padded, torch.float32)
    shard = full[..., start:end]
    # 37 is a padding id (inside the sharded width, outside the real vocabulary).
    for bad in (vocab, -1, padded, 10**6):
        wrong = target.clone()
        wrong[1, 0] = bad
        with pytest.raises(ValueError, match=f"target id {bad} .* vocabulary of size {vocab}"):
            vocab_parallel_cross_entropy(shard, wrong, tp_group=group, vocab_size=vocab)
    with pytest.raises(ValueError, match=f"target id {padded} .* vocabulary of size {padded}"):
        wrong[1, 0] = padded
        vocab_parallel_cross_entropy(shard, wrong, tp_group=group)  # default: the padded width
    # The errors came before any collective: the group is still in step.
    loss = vocab_parallel_cross_entropy(shard, target, tp_group=group, vocab_size=vocab)
    ref = F.cross_entropy(
        full[..., :vocab].reshape(-1, vocab), target.reshape(-1), reduction="none"
    )
    torch.testing.assert_close(loss, ref.view(S, B), **FP32_TOL)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_out_of_range_target_on_gpu_fails_the_device_assertion():
    # A failed device assertion poisons its process's CUDA context, so it runs in its own.
    script = (
        "import torch\n"
        "from megapp.tensor_parallel import vocab_parallel_cross_entropy as ce\n"
        "logits = torch.randn(3, 2, 8, device='cuda')\n"
        "target = torch.randint(0, 7, (3, 2), device='cuda')\n"
        "ce(logits, target, vocab_size=7).sum().item()\n"  # valid ids pass
        "print('valid ok', flush=True)\n"
        "target[1, 0] = 7\n"
        "ce(logits, target, vocab_size=7)\n"
        "torch.cuda.synchronize()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert "valid ok" in done.stdout
    assert done.returncode != 0
    assert "device-side assert" in done.stderr  # CUDA reports the failed assertion


def test_argument_errors():
    logits, target = torch.zeros(2, 3, 8), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"target must be logits_shard\.shape"):
        vocab_parallel_cross_entropy(logits, target[0])
    with pytest.raises(ValueError, match="integer ids"):
        vocab_parallel_cross_entropy(logits, target.float())
    with pytest.raises(ValueError, match=r"vocab_size 9 is outside \[1, 8\]"):
        vocab_parallel_cross_entropy(logits, target, vocab_size=9)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        vocab_parallel_cross_entropy(logits, target, label_smoothing=1.0)


@pytest.mark.parametrize("fused", [True, False])
def test_backward_twice_with_retain_graph(fused):
    # Backward only reads what it saved, so a retained graph gives the same gradient again.
    logits = torch.randn(2, 3, 8, requires_grad=True)
    with extension.fused(fused):
        loss = vocab_parallel_cross_entropy(logits, torch.tensor([[0, 7, 3], [5, 5, 1]]), 0.1)
        loss.sum().backward(retain_graph=True)
        once = logits.grad.clone()
        loss.sum().backward()
    assert torch.equal(logits.grad, 2 * once)
    assert not torch.equal(once, torch.zeros_like(once))


def test_pad_vocab_size_and_vocab_range():
    assert pad_vocab_size(50257, 1) == 50304  # Megatron's GPT-2 vocabulary at tp 1
    assert pad_vocab_size(50257, 2) == 50432
    assert pad_vocab_size(50257, 4) == 50688
    assert pad_vocab_size(50257, 8, multiple=1) == 50264
    assert pad_vocab_size(256, 2) == 256  # already a multiple of 128 × 2
    assert pad_vocab_size(37, 4, multiple=1) == 40
    ranges = [vocab_range(50688, r, 4) for r in range(4)]
    assert ranges == [(0, 12672), (12672, 25344), (25344, 38016), (38016, 50688)]
    with pytest.raises(ValueError, match="not divisible by the 4 tensor-parallel ranks"):
        vocab_range(50257, 0, 4)
    with pytest.raises(ValueError, match=r"rank 4 is outside \[0, 4\)"):
        vocab_range(50688, 4, 4)
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        pad_vocab_size(0, 2)
