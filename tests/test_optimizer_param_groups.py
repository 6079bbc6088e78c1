"""Weight-decay param groups: which parameters decay, in which order."""

import torch
from torch import nn

from megapp.optimizer import get_param_groups


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 6)
        self.out = nn.Linear(6, 4, bias=False)
        self.scale = nn.Parameter(torch.ones(4))  # 1-D but not named bias: no decay
        self.frozen = nn.Parameter(torch.ones(3, 3), requires_grad=False)


def _names(module, group):
    by_id = {id(p): name for name, p in module.named_parameters()}
    return [by_id[id(p)] for p in group["params"]]


def test_matrices_decay_and_biases_norms_and_vectors_do_not():
    block = _Block()
    decay, no_decay = get_param_groups(block, weight_decay=0.1)
    assert _names(block, decay) == ["proj.weight", "out.weight"]
    assert _names(block, no_decay) == ["scale", "norm.weight", "norm.bias", "proj.bias"]
    assert (decay["weight_decay"], decay["wd_mult"]) == (0.1, 1.0)
    assert (no_decay["weight_decay"], no_decay["wd_mult"]) == (0.0, 0.0)


def test_named_pairs_and_model_chunks_give_the_same_groups():
    chunks = [_Block(), _Block()]
    from_chunks = get_param_groups(chunks, weight_decay=0.1)
    pairs = [(name, p) for chunk in chunks for name, p in chunk.named_parameters()]
    from_pairs = get_param_groups(iter(pairs), weight_decay=0.1)
    for a, b in zip(from_chunks, from_pairs, strict=True):
        assert [id(p) for p in a["params"]] == [id(p) for p in b["params"]]
    assert [len(g["params"]) for g in from_chunks] == [4, 8]


def test_a_tensor_seen_twice_is_grouped_once():
    block = _Block()
    pairs = [*block.named_parameters(), ("tied.weight", block.proj.weight)]
    decay, _ = get_param_groups(pairs, weight_decay=0.1)
    assert _names(block, decay) == ["proj.weight", "out.weight"]


def test_custom_rule_and_empty_groups_dropped():
    block = _Block()
    groups = get_param_groups(block, weight_decay=0.1, no_decay_fn=lambda name, p: True)
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.0
    assert len(groups[0]["params"]) == 6
    assert get_param_groups(nn.Linear(3, 3, bias=False), 0.1)[0]["weight_decay"] == 0.1
    assert len(get_param_groups(nn.Linear(3, 3, bias=False), 0.1)) == 1
