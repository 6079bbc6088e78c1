"""The MoE layer in one process against a plain reference written here, token by token.

The reference routes each token with Python's own sort, runs each chosen expert's two
matmuls on that token alone, drops pairs past capacity by sorting each expert's pairs,
and writes the auxiliary losses from their formulas. Layer and reference share weights
(float64); outputs, losses and the gradients of the input and of every weight must agree
to 1e-10 relative / 1e-12 absolute: both compute the same sums in different orders, so
they differ by float64 round-off (1e-16 relative), while a wrong routing, weight or
loss term changes values at 1e-3 or more.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from megapp.moe import MoEConfig, MoELayer, aux_losses, layer_losses
from megapp.moe.capacity import expert_capacity, kept_pairs
from megapp.moe.experts import grouped_mm_supported
from megapp.moe.permutation import (
    combine_slots,
    permute,
    sort_by_expert,
    unpermute,
    weigh_rows,
)
from megapp.parallel_state import TrainGroups
from megapp.training.step import moe_losses, routed_tokens

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}
S, B, H, E, FFN = 6, 3, 8, 4, 6


def _config(**overrides) -> MoEConfig:
    settings = dict(
        hidden_size=H,
        num_moe_experts=E,
        moe_ffn_hidden_size=FFN,
        moe_router_topk=2,
        moe_aux_loss_coeff=0.1,
        params_dtype=F64,
        init_method_std=0.5,  # large weights spread the router's choices
    )
    settings.update(overrides)
    return MoEConfig(**settings)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


# ----- the reference --------------------------------------------------------------------


def _act(z, kind):
    if kind == "swiglu":
        g, u = z.chunk(2)
        return g * torch.sigmoid(g) * u
    if kind == "gelu":
        return 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
    return 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))


def _expert(w, e, x, config):
    inner = x @ w["fc1"][e] + (w["fc1_bias"][e] if "fc1_bias" in w else 0)
    out = _act(inner, config.activation) @ w["fc2"][e]
    return out + (w["fc2_bias"][e] if "fc2_bias" in w else 0)


def _choose(z, config, bias):
    """[(expert, weight)] of one token's logits z [E]."""
    k = config.moe_router_topk

    def order(scores):
        return sorted(range(E), key=lambda e: -float(scores[e].detach()))

    if config.moe_router_score_function == "softmax" and not config.moe_router_pre_softmax:
        top = order(z)[:k]
        weights = torch.softmax(z[top], 0)
    elif config.moe_router_score_function == "softmax":
        p = torch.softmax(z, 0)
        top = order(p)[:k]
        weights = p[top] / (p[top].sum() if config.moe_router_norm_topk_prob else 1)
    else:
        sig = torch.sigmoid(z)
        top = order(sig + bias)[:k]
        weights = sig[top] / (sig[top].sum() + 1e-20 if k > 1 else 1)
    weights = weights * (config.moe_router_topk_scaling_factor or 1)
    return list(zip(top, weights, strict=True))


def _value(p) -> float:
    return float(p.detach()) if isinstance(p, torch.Tensor) else float(p)


def _drop(choices, config):
    """Leave each expert the capacity pairs its rule keeps (reference of capacity.py)."""
    if config.moe_expert_capacity_factor is None:
        return choices
    capacity = math.ceil(
        len(choices) * config.moe_router_topk / E * config.moe_expert_capacity_factor
    )
    keep = set()
    for e in range(E):
        pairs = [(t, _value(p)) for t, c in enumerate(choices) for x, p in c if x == e]
        if config.moe_token_drop_policy == "probs":
            pairs.sort(key=lambda pair: (-pair[1], pair[0]))
        keep |= {(t, e) for t, _ in pairs[:capacity]}
    return [[(e, p) for e, p in c if (t, e) in keep] for t, c in enumerate(choices)]


def _balance(scores, k, coeff):
    """coeff · E · Σ_e f_e P_e of one set of tokens' scores [T, E]."""
    t = scores.shape[0]
    counts = torch.zeros(E, dtype=F64)
    for row in scores.detach():
        for e in sorted(range(E), key=lambda e: -float(row[e]))[:k]:
            counts[e] += 1
    return coeff * E * sum(counts[e] / (t * k) * scores[:, e].mean() for e in range(E))


def reference(x, w, config, bias=None, routed_by=None):
    """(out [s, b, h], losses with coefficients) of tokens x [s, b, h] and weights w.
    ``routed_by``: logits [s·b, E] that route in place of the router's, which receive their
    gradient."""
    s, b, h = x.shape
    tokens = x.reshape(s * b, h)
    logits = tokens @ w["router"].t()
    if routed_by is not None:
        logits = routed_by + (logits - logits.detach())
    choices = _drop([_choose(z, config, bias) for z in logits], config)
    rows = []
    for t, chosen in enumerate(choices):
        row = torch.zeros(h, dtype=F64)
        for e, weight in chosen:
            row = row + weight * _expert(w, e, tokens[t], config)
        if "shared_fc1" in w:
            shared = _act(w["shared_fc1"] @ tokens[t], config.activation) @ w["shared_fc2"].t()
            if "shared_gate" in w:
                shared = shared * torch.sigmoid(w["shared_gate"] @ tokens[t])
            row = row + shared
        rows.append(row)
    losses = {}
    k, coeff = config.moe_router_topk, config.moe_aux_loss_coeff
    if config.moe_router_score_function == "softmax":
        scores = torch.softmax(logits, -1)
    else:
        scores = torch.sigmoid(logits) / torch.sigmoid(logits).sum(-1, keepdim=True)
    if config.moe_router_load_balancing_type == "aux_loss":
        losses["load_balancing_loss"] = _balance(scores, k, coeff)
    elif config.moe_router_load_balancing_type == "seq_aux_loss":
        per_sequence = [_balance(scores.view(s, b, E)[:, j], k, coeff) for j in range(b)]
        losses["seq_load_balancing_loss"] = sum(per_sequence) / b
    if config.moe_z_loss_coeff:
        lse = torch.stack([torch.log(torch.exp(z).sum()) for z in logits])
        losses["z_loss"] = config.moe_z_loss_coeff * (lse**2).mean()
    return torch.stack(rows).view(s, b, h), losses


def weights_of(layer):
    """The layer's weights by the reference's names (clones that collect gradients)."""
    w = {
        "router": layer.router.weight,
        "fc1": layer.experts.fc1,
        "fc2": layer.experts.fc2,
    }
    if layer.experts.fc1_bias is not None:
        w.update(fc1_bias=layer.experts.fc1_bias, fc2_bias=layer.experts.fc2_bias)
    if layer.shared_expert is not None:
        w.update(
            shared_fc1=layer.shared_expert.linear_fc1.weight,
            shared_fc2=layer.shared_expert.linear_fc2.weight,
        )
        if layer.shared_expert.gate_weight is not None:
            w["shared_gate"] = layer.shared_expert.gate_weight[0]
    return {name: t.detach().clone().requires_grad_() for name, t in w.items()}


def grads_of(layer):
    """The layer's weight gradients by the reference's names."""
    return {
        name: grad
        for name, grad in {
            "router": layer.router.weight.grad,
            "fc1": layer.experts.fc1.grad,
            "fc2": layer.experts.fc2.grad,
            "fc1_bias": getattr(layer.experts.fc1_bias, "grad", None),
            "fc2_bias": getattr(layer.experts.fc2_bias, "grad", None),
            "shared_fc1": layer.shared_expert and layer.shared_expert.linear_fc1.weight.grad,
            "shared_fc2": layer.shared_expert and layer.shared_expert.linear_fc2.weight.grad,
            "shared_gate": layer.shared_expert
            and layer.shared_expert.gate_weight is not None
            and layer.shared_expert.gate_weight.grad[0],
        }.items()
        if isinstance(grad, torch.Tensor)
    }


CASES = {
    "softmax-topk-swiglu": dict(moe_z_loss_coeff=1e-2),
    "pre-softmax-gelu-bias": dict(
        moe_router_pre_softmax=True, activation="gelu", add_bias_linear=True
    ),
    "pre-softmax-renormalized-gelu-erf": dict(
        moe_router_pre_softmax=True, moe_router_norm_topk_prob=True, activation="gelu_erf"
    ),
    "sigmoid-expert-bias-seq-loss": dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk=3,
        moe_router_topk_scaling_factor=2.5,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_z_loss_coeff=1e-3,
    ),
    "capacity-probs-shared-gate": dict(
        moe_expert_capacity_factor=0.75,
        moe_shared_expert_intermediate_size=5,
        moe_shared_expert_gate=True,
    ),
    "capacity-position-top1-bias": dict(
        moe_expert_capacity_factor=1.0,
        moe_token_drop_policy="position",
        moe_router_topk=1,
        add_bias_linear=True,
        moe_shared_expert_intermediate_size=4,
        activation="gelu",
    ),
}


def _layer(config, seed=0):
    torch.manual_seed(seed)
    layer = MoELayer(config)
    with torch.no_grad():  # nonzero biases, so a misplaced bias shows
        for bias in (layer.experts.fc1_bias, layer.experts.fc2_bias):
            if bias is not None:
                bias.copy_(_randn(*bias.shape, seed=7))
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.copy_(_randn(E, seed=8) * 0.3)
    return layer


@pytest.mark.parametrize("case", CASES)
def test_layer_equals_the_reference_forward_and_backward(case):
    config = _config(**CASES[case])
    layer = _layer(config)
    x = _randn(S, B, H, seed=1).requires_grad_()
    grad_out = _randn(S, B, H, seed=2)
    out, bias = layer(x)
    assert bias is None and out.shape == (S, B, H)
    (out * grad_out).sum().backward()

    w = weights_of(layer)
    x_ref = x.detach().clone().requires_grad_()
    out_ref, losses_ref = reference(x_ref, w, config, bias=layer.router.expert_bias)
    total = (out_ref * grad_out).sum() + sum(losses_ref.values())
    total.backward()

    torch.testing.assert_close(out, out_ref, **TOL)
    assert set(layer.losses) == set(losses_ref)
    coeffs = {"z_loss": config.moe_z_loss_coeff}
    for name, value in losses_ref.items():
        coeff = coeffs.get(name, config.moe_aux_loss_coeff)
        torch.testing.assert_close(layer.losses[name] * coeff, value.detach(), **TOL)
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    grads = grads_of(layer)
    assert set(grads) == set(w)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, w[name].grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    if config.moe_expert_capacity_factor is not None:  # the case really drops pairs
        routing = layer.router(x.detach().reshape(-1, H), B)
        assert 0 < int((~routing.kept).sum()) < routing.kept.numel()


def test_forced_balance_routes_by_random_logits_and_trains_the_router_through_them():
    """moe_router_force_load_balancing routes by standard normal logits from the tracker's
    tensor-parallel stream; the reference routes by the same draws and hands their gradient
    to the router's logits. Outputs, losses and every gradient agree."""
    from megapp.tensor_parallel.random import get_rng_tracker, model_parallel_manual_seed

    model_parallel_manual_seed(11)
    config = _config(moe_router_force_load_balancing=True, moe_z_loss_coeff=0.1)
    layer = _layer(config)
    x = _randn(S, B, H, seed=1).requires_grad_()
    grad_out = _randn(S, B, H, seed=2)
    states = get_rng_tracker().get_states()
    out, _ = layer(x)
    (out * grad_out).sum().backward()

    get_rng_tracker().set_states(states)
    with get_rng_tracker().fork():
        drawn = torch.randn(S * B, E, dtype=F64)
    own = x.detach().reshape(-1, H) @ layer.router.weight.detach().t()
    assert not torch.equal(drawn.topk(2).indices, own.topk(2).indices)  # routes otherwise
    w = weights_of(layer)
    x_ref = x.detach().clone().requires_grad_()
    out_ref, losses_ref = reference(x_ref, w, config, routed_by=drawn)
    ((out_ref * grad_out).sum() + sum(losses_ref.values())).backward()
    torch.testing.assert_close(out, out_ref, **TOL)
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    torch.testing.assert_close(layer.router.weight.grad, w["router"].grad, **TOL)
    assert layer.router.weight.grad.abs().sum() > 0


def test_forced_balance_gives_every_expert_its_share():
    """Over 4096 tokens choosing 2 of 4 experts each expert gets 2048 pairs give or take
    five standard deviations (about 28 each), whatever the router's weights prefer."""
    from megapp.tensor_parallel.random import model_parallel_manual_seed

    model_parallel_manual_seed(0)
    skewed = _layer(_config(moe_router_force_load_balancing=True))
    with torch.no_grad():
        skewed.router.weight.zero_()
        skewed.router.weight[0] = 10.0  # every token would choose expert 0
    x = _randn(4096, 1, H, seed=4).abs()
    counts = torch.bincount(skewed.router(x.reshape(-1, H)).experts.reshape(-1), minlength=E)
    assert (counts - 2048).abs().max() < 5 * 28, counts


def test_losses_leave_the_output_and_only_add_gradients():
    """The attached losses change no forward value, and evaluation attaches none."""
    plain = _layer(_config(moe_aux_loss_coeff=0.0))
    lossy = _layer(_config(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.5))
    x = _randn(S, B, H, seed=3)
    torch.testing.assert_close(plain(x)[0], lossy(x)[0], rtol=0, atol=0)
    assert plain.losses == {} and set(lossy.losses) == {"load_balancing_loss", "z_loss"}
    lossy.eval()
    lossy(x)
    assert lossy.losses == {}
    # the loss's gradient is the layer's aux_loss_scale
    lossy.train()
    lossy.aux_loss_scale = 0.25
    lossy.zero_grad()
    (lossy(x)[0] * 0).sum().backward()  # only the auxiliary losses reach the router
    w = weights_of(lossy)
    _, losses = reference(x, w, lossy.config)
    (0.25 * sum(losses.values())).backward()
    torch.testing.assert_close(lossy.router.weight.grad, w["router"].grad, **TOL)
    assert layer_losses(torch.nn.Sequential(lossy)) == {
        name: {1: float(v)} for name, v in lossy.losses.items()
    }


def test_aux_loss_formula_golden():
    # two experts, k = 1, four tokens: three choose expert 0
    scores = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]], dtype=F64)
    chosen = torch.tensor([[1.0, 0], [1, 0], [1, 0], [0, 1]], dtype=F64)
    # f = (3/4, 1/4), P = (2.6/4, 1.4/4): E · Σ f P = 2 · (0.4875 + 0.0875) = 1.15
    loss = aux_losses.load_balancing_loss(scores, chosen, topk=1, coeff=1.0)
    torch.testing.assert_close(loss, torch.tensor(1.15, dtype=F64), **TOL)
    even = torch.full((4, 2), 0.5, dtype=F64)
    balanced = torch.tensor([[1.0, 0], [0, 1], [1, 0], [0, 1]], dtype=F64)
    assert float(aux_losses.load_balancing_loss(even, balanced, 1, 0.01)) == pytest.approx(0.01)
    logits = torch.tensor([[0.0, 0.0], [math.log(3), 0.0]], dtype=F64)
    # logsumexp: log 2 and log 4
    expected = (math.log(2) ** 2 + math.log(4) ** 2) / 2
    assert float(aux_losses.z_loss(logits, 1.0)) == pytest.approx(expected)


def test_expert_bias_moves_towards_balance():
    config = _config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    layer = _layer(config)
    layer.router.expert_bias.zero_()
    x = _randn(S, B, H, seed=4)
    layer(x)
    counts = layer.router.local_tokens_per_expert.clone()
    assert int(counts.sum()) == S * B * 2
    layer.router.update_expert_bias()
    rate = config.moe_router_bias_update_rate
    expected = rate * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(layer.router.expert_bias, expected.float(), rtol=0, atol=0)
    assert int(layer.router.local_tokens_per_expert.sum()) == 0
    with torch.no_grad():  # no counting without gradients (evaluation, recompute)
        layer(x)
    assert int(layer.router.local_tokens_per_expert.sum()) == 0
    # the bias shifts the choice, never the weights: a huge bias on expert 0 picks it always
    layer.router.expert_bias.copy_(torch.tensor([100.0, 0, 0, 0]))
    routing = layer.router(x.reshape(-1, H))
    assert bool((routing.experts == 0).any(dim=1).all())
    assert float(routing.probs.detach().max()) <= 1.0


# ----- capacity ----------------------------------------------------------------------


def test_expert_load_equals_a_hand_count():
    """Two layers whose router weight is [I | 0]: a token 2·e_a + e_b picks experts a and b.
    Layer 0 routes (0,1) (0,1) (0,2) (0,3): counts [4, 2, 1, 1], mean 2, max/mean 2, min/mean
    1/2; layer 1 routes (0,1) (1,0) (2,0) (1,2): counts [3, 3, 2, 0], max 3/2, min 0."""
    pairs = {0: [(0, 1), (0, 1), (0, 2), (0, 3)], 1: [(0, 1), (1, 0), (2, 0), (1, 2)]}
    layers = [MoELayer(_config(), layer_number=n) for n in pairs]
    for layer, routes in zip(layers, pairs.values(), strict=True):
        with torch.no_grad():
            layer.router.weight.copy_(torch.eye(E, H, dtype=F64))
        x = torch.zeros(len(routes), 1, H, dtype=F64)
        for t, (a, b) in enumerate(routes):
            x[t, 0, a], x[t, 0, b] = 2.0, 1.0
        for _ in range(2):  # two microbatches: the counts add up
            layer(x)
        with torch.no_grad():  # evaluation does not count
            layer(x)
    assert layers[1].router.local_tokens_per_expert.tolist() == [6.0, 6.0, 4.0, 0.0]

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(layers)
            self.module = SimpleNamespace(
                config=SimpleNamespace(num_moe_experts=E, num_layers=2, is_moe_layer=bool)
            )

    chunks, groups = [Chunk()], TrainGroups()
    routed = routed_tokens(chunks, groups)
    assert [counts.tolist() for _, counts in routed] == [[8, 4, 2, 2], [6, 6, 4, 0]]
    assert all(int(layer.router.local_tokens_per_expert.sum()) == 0 for layer in layers)
    figures = moe_losses(chunks, groups, routed)
    assert (figures["expert_load_max"], figures["expert_load_min"]) == (2.0, 0.0)
    assert "load_balancing_loss" in figures
    assert "expert_load_max" not in moe_losses(chunks, groups, routed_tokens(chunks, groups))


def test_capacity_golden_and_ties():
    assert expert_capacity(18, 4, 2, 0.75) == 7 and expert_capacity(8, 4, 1, 1.0) == 2
    experts = torch.tensor([[0], [0], [0], [1]])
    probs = torch.tensor([[0.5], [0.9], [0.5], [0.2]])
    by_probs = kept_pairs(probs, experts, 2, capacity=2, policy="probs")
    assert by_probs.view(-1).tolist() == [True, True, False, True]  # tie: the earlier token
    by_position = kept_pairs(probs, experts, 2, capacity=2, policy="position")
    assert by_position.view(-1).tolist() == [True, True, False, True]
    by_probs = kept_pairs(probs, experts, 2, capacity=1, policy="probs")
    assert by_probs.view(-1).tolist() == [False, True, False, True]


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_equals_sorting_each_experts_pairs(policy):
    config = _config(
        moe_expert_capacity_factor=0.5, moe_token_drop_policy=policy, moe_router_topk=2
    )
    for seed in range(5):
        logits = _randn(40, E, seed=seed)
        probs, experts = torch.topk(torch.softmax(logits, -1), 2)
        probs = torch.where(probs > 0.3, probs, torch.full_like(probs, 0.3))  # many ties
        capacity = expert_capacity(40, E, 2, 0.5)
        kept = kept_pairs(probs, experts, E, capacity, policy)
        choices = [
            list(zip(e.tolist(), p.tolist(), strict=True))
            for e, p in zip(experts, probs, strict=True)
        ]
        expected = _drop(choices, config)
        got = [[(int(e), float(p)) for e, p, keep in zip(ee, pp, kk, strict=True) if keep]
               for ee, pp, kk in zip(experts, probs, kept, strict=True)]  # fmt: skip
        assert got == [[(e, float(p)) for e, p in c] for c in expected]


# ----- permutation and the grouped matmul --------------------------------------------


def test_permute_unpermute_round_trip():
    experts = torch.tensor([[2, 0], [1, 2], [0, 3], [2, 1]])
    kept = torch.tensor([[True, True], [True, False], [True, True], [True, True]])
    perm = sort_by_expert(experts, kept, 4)
    assert perm.tokens_per_expert.tolist() == [2, 2, 2, 1]
    assert perm.tokens.tolist() == [0, 2, 1, 3, 0, 3, 2]  # by expert, token order within
    x = _randn(4, 3, seed=5)
    rows = permute(x, perm)
    back = unpermute(rows, perm)  # [T, k, h]: each kept pair's row is its token
    for t in range(4):
        for slot in range(2):
            expected = x[t] if kept[t, slot] else torch.zeros(3, dtype=F64)
            assert torch.equal(back[t, slot], expected)
    probs = torch.tensor([[0.25, 0.75], [1.0, 0.0], [0.5, 0.5], [0.1, 0.9]], dtype=F64)
    torch.testing.assert_close(
        combine_slots(back, probs), x * probs.where(kept, 0).sum(1, keepdim=True)
    )


def test_grouped_matmul_equals_the_loop():
    assert grouped_mm_supported(torch.float32, torch.device("cpu"), 16, 8)
    assert not grouped_mm_supported(torch.float32, torch.device("cpu"), 6)
    assert not grouped_mm_supported(F64, torch.device("cpu"), 16)
    outs, grads = [], []
    for grouped in (True, False):
        config = _config(params_dtype=torch.float32, hidden_size=16, moe_ffn_hidden_size=8,
                         moe_grouped_gemm=grouped, add_bias_linear=True)  # fmt: skip
        layer = _layer(config)
        x = _randn(S, B, 16, seed=6).float().requires_grad_()
        assert layer.experts.uses_grouped_mm(x.view(-1, 16)) == grouped
        out, _ = layer(x)
        out.square().sum().backward()
        outs.append(out)
        grads.append([x.grad] + [p.grad for p in layer.parameters()])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weighing_keeps_the_rows_in_their_dtype_with_the_same_values(dtype):
    """weigh_rows against autograd through the widened product: the same output and
    gradients bit for bit, while backward keeps the 16-bit rows, not a float32 copy."""
    y = _randn(5, 3, 8, seed=11).to(dtype)
    probs = _randn(5, 3, seed=12).float().softmax(-1)
    grad = _randn(5, 8, seed=13).to(dtype)
    results = []
    for weigh in (weigh_rows, lambda a, b: a.float() * b.float().unsqueeze(-1)):
        a, b = y.clone().requires_grad_(), probs.clone().requires_grad_()
        kept = set()

        def pack(t: torch.Tensor, kept=kept) -> torch.Tensor:
            kept.add((t.dtype, t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = weigh(a, b).sum(1).to(dtype)
        out.backward(grad)
        results.append((out, a.grad, b.grad, kept))
    for mine, autograd in zip(results[0][:3], results[1][:3], strict=True):
        assert torch.equal(mine, autograd)
    assert (dtype, y.shape) in results[0][3]
    if dtype == torch.bfloat16:  # autograd keeps a float32 copy of the rows; weigh_rows not
        assert (torch.float32, y.shape) in results[1][3]
        assert (torch.float32, y.shape) not in results[0][3]


def test_rebuilding_the_experts_activations_changes_no_gradient():
    """The experts rebuild their activations' outputs in backward from the pre-activations
    (as the dense MLP does); the gradients equal keeping them, bit for bit."""
    grads = []
    for rebuild in (True, False):
        layer = _layer(_config(activation="swiglu", moe_shared_expert_intermediate_size=4))
        layer.recompute_saved_inputs = rebuild
        assert layer.shared_expert.recompute_saved_inputs == rebuild
        x = _randn(S, B, H, seed=6).requires_grad_()
        out, _ = layer(x)
        out.square().sum().backward()
        grads.append([x.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_same_seed_same_experts_under_any_expert_parallel_size():
    torch.manual_seed(3)
    whole = MoELayer(_config())
    for ep in (2, 4):
        for rank in range(ep):
            torch.manual_seed(3)
            config = _config(expert_model_parallel_size=ep)
            from megapp.moe.experts import GroupedExperts
            from megapp.moe.router import Router

            router = Router(config)
            part = GroupedExperts(config, rank)
            assert torch.equal(router.weight, whole.router.weight)
            local = E // ep
            assert torch.equal(part.fc1, whole.experts.fc1[rank * local : (rank + 1) * local])
            assert torch.equal(part.fc2, whole.experts.fc2[rank * local : (rank + 1) * local])


# ----- bad input ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_moe_experts=6, expert_model_parallel_size=4),
         "num_moe_experts (6) is not divisible by expert_model_parallel_size (4)"),
        (dict(moe_router_topk=5), "moe_router_topk (5) is larger than num_moe_experts (4)"),
        (dict(moe_router_score_function="sparsemixer"),
         "moe_router_score_function must be one of ('softmax', 'sigmoid'), got 'sparsemixer'"),
        (dict(moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type must be one of"),
        (dict(moe_router_load_balancing_type="sinkhorn"), "moe_router_load_balancing_type must"),
        (dict(moe_token_drop_policy="random"), "moe_token_drop_policy must be one of"),
        (dict(activation="relu"), "activation must be one of"),
        (dict(moe_router_enable_expert_bias=True), "needs moe_router_score_function 'sigmoid'"),
        (dict(moe_router_norm_topk_prob=True), "applies to the softmax router with moe_router_pre"),
        (dict(moe_expert_capacity_factor=0.0), "moe_expert_capacity_factor must be > 0"),
        (dict(moe_shared_expert_gate=True), "needs moe_shared_expert_intermediate_size"),
        (dict(moe_router_topk=0), "moe_router_topk must be an integer >= 1"),
        (dict(expert_model_parallel_size=0), "expert_model_parallel_size must be an integer"),
        (dict(moe_z_loss_coeff=-1.0), "moe_z_loss_coeff must be >= 0"),
        (
            dict(expert_tensor_parallel_size=4),
            "moe_ffn_hidden_size (6) is not divisible by expert_tensor_parallel_size (4)",
        ),
    ],
)  # fmt: skip
def test_bad_config_raises_one_line_errors(overrides, message):
    with pytest.raises(ValueError) as info:
        _config(**overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_layer_rejects_bad_input():
    with pytest.raises(
        ValueError, match=r"expert_model_parallel_size is 2 but the expert-parallel group has 1"
    ):
        MoELayer(_config(expert_model_parallel_size=2))
    with pytest.raises(ValueError, match=r"expert_tensor_parallel_size is 2 but the expert tensor"):
        MoELayer(_config(expert_tensor_parallel_size=2))
    layer = MoELayer(_config())
    with pytest.raises(ValueError, match=r"MoELayer takes \[s, b, 8\] tokens, got \(4, 8\)"):
        layer(torch.zeros(4, H, dtype=F64))
    with pytest.raises(ValueError, match="update_expert_bias needs moe_router_enable_expert_bias"):
        layer.router.update_expert_bias()
