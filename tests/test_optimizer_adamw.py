"""AdamW choice and update, against the algorithm written out by hand.

The parameters are float64, so the hand-written update and torch's foreach kernel differ only
by round-off (1e-12 relative).
"""

import logging

import pytest
import torch
from torch import nn

from megapp.optimizer import adamw as adamw_module
from megapp.optimizer import build_adamw, choose_adamw, get_param_groups

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1


def _adamw_reference(param, grads, weight_decay):
    """Decoupled-weight-decay Adam, one step per gradient in ``grads``."""
    beta1, beta2 = BETAS
    m, v = torch.zeros_like(param), torch.zeros_like(param)
    for t, grad in enumerate(grads, start=1):
        param = param * (1 - LR * weight_decay)
        m = beta1 * m + (1 - beta1) * grad
        v = beta2 * v + (1 - beta2) * grad * grad
        m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
        param = param - LR * m_hat / (v_hat.sqrt() + EPS)
    return param


def test_choice_is_a_pure_function_of_device_and_apex():
    assert choose_adamw(all_cuda=True, apex_available=True) == "apex"
    assert choose_adamw(all_cuda=True, apex_available=False) == "torch_fused"
    assert choose_adamw(all_cuda=False, apex_available=True) == "torch_foreach"
    assert choose_adamw(all_cuda=False, apex_available=False) == "torch_foreach"


def test_cpu_gets_foreach_adamw_and_logs_the_choice_once(caplog):
    adamw_module._log_choice.cache_clear()
    params = [nn.Parameter(torch.zeros(2))]
    with caplog.at_level(logging.INFO, logger=adamw_module.__name__):
        optimizer = build_adamw(params, lr=LR)
        build_adamw(params, lr=LR)
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["foreach"] is True and not optimizer.defaults["fused"]
    messages = [r.getMessage() for r in caplog.records if "AdamW uses" in r.getMessage()]
    assert len(messages) == 1 and "torch_foreach" in messages[0]  # once, naming the choice


def test_steps_match_hand_written_adamw_with_decay_only_on_matrices():
    torch.manual_seed(0)
    model = nn.Linear(5, 3).double()
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = build_adamw(get_param_groups(model, WD), lr=LR, betas=BETAS, eps=EPS)
    grads = {name: [torch.randn_like(p) for _ in range(3)] for name, p in start.items()}
    for step in range(3):
        for name, p in model.named_parameters():
            p.grad = grads[name][step].clone()
        optimizer.step()
    expected = {
        "weight": _adamw_reference(start["weight"], grads["weight"], WD),
        "bias": _adamw_reference(start["bias"], grads["bias"], 0.0),
    }
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-12, atol=1e-14)
    # The decay matters: without it the weight would end elsewhere.
    undecayed = _adamw_reference(start["weight"], grads["weight"], 0.0)
    assert not torch.allclose(model.weight.detach(), undecayed, rtol=1e-6, atol=0.0)


def test_no_parameters_raises():
    with pytest.raises(ValueError, match="no parameters"):
        build_adamw([], lr=LR)
