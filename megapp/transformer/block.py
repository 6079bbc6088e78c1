"""A stack of transformer layers with Megatron's recompute settings."""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.func import functional_call

from megapp.tensor_parallel.mappings import Group
from megapp.tensor_parallel.random import checkpoint
from megapp.transformer.config import ExpertGroups, TransformerConfig
from megapp.transformer.layer import TransformerLayer, build_norm


def _build_layer(
    config: TransformerConfig,
    number: int,
    tp_group: Group,
    init_seed: int | None,
    cp_group: Group,
    expert_groups: ExpertGroups | None,
) -> TransformerLayer:
    if init_seed is None:
        return TransformerLayer(config, number, tp_group, cp_group, expert_groups)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed + number)
        return TransformerLayer(config, number, tp_group, cp_group, expert_groups)


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s parameters and buffers by name, as its forward sees them now."""
    named = itertools.chain(
        module.named_parameters(remove_duplicate=False),
        module.named_buffers(remove_duplicate=False),
    )
    return dict(named)


def _holds(module: nn.Module, tensors: dict[str, torch.Tensor]) -> bool:
    return all(t is tensors.get(name) for name, t in _tensors(module).items())


class TransformerBlock(nn.Module):
    """Layers ``first_layer .. first_layer + num_layers - 1`` of the model (a pipeline
    chunk holds a slice, none in a chunk of only the embedding or the loss), optionally
    followed by the final norm.

    Recompute (``config.recompute_granularity``):
      - ``selective``: each layer's core attention is recomputed (Megatron's choice:
        the s²-sized part that is cheap to redo).
      - ``full`` + ``uniform``: layers are checkpointed in groups of
        ``recompute_num_layers``; only each group's input is kept.
      - ``full`` + ``block``: the first ``recompute_num_layers`` layers of this block
        are checkpointed one by one, the rest keep their activations.
    Recomputed forwards restore every RNG state, so they are bit-identical.
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        first_layer: int = 0,
        num_layers: int | None = None,
        post_layer_norm: bool = True,
        tp_group: Group = None,
        init_seed: int | None = None,
        cp_group: Group = None,
        expert_groups: ExpertGroups | None = None,
    ):
        """``init_seed``: build layer ``l`` from the default generator seeded with
        ``init_seed + l`` (restored afterwards), so a layer's initial weights do not
        depend on which pipeline chunk builds it; ``None`` draws from the generator
        as it stands. ``expert_groups``: the groups of mixture-of-experts layers."""
        super().__init__()
        self.config = config
        num_layers = config.num_layers if num_layers is None else num_layers
        if num_layers < 0 or first_layer < 0 or first_layer + num_layers > config.num_layers:
            raise ValueError(
                f"layers {first_layer}..{first_layer + num_layers - 1} are outside the model's "
                f"{config.num_layers} layers"
            )
        self.layers = nn.ModuleList(
            _build_layer(config, first_layer + i, tp_group, init_seed, cp_group, expert_groups)
            for i in range(num_layers)
        )
        self.final_layernorm = build_norm(config) if post_layer_norm else None
        for i in self._recomputed_layers():
            self.layers[i].recompute_saved_inputs = False  # the whole layer is rebuilt anyway

    def _recomputed_layers(self) -> set[int]:
        config, n = self.config, len(self.layers)
        if config.recompute_granularity != "full":
            return set()
        if config.recompute_method == "uniform":
            return set(range(n))
        return set(range(min(config.recompute_num_layers, n)))

    def _run(
        self,
        start: int,
        end: int,
        x: torch.Tensor,
        rotary_freqs,
        weights: list[dict[str, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Layers ``start .. end - 1`` on x; ``weights``: each layer's tensors by name, used
        where the layer no longer holds them (a recompute after torch.func.functional_call)."""
        for i, layer in enumerate(self.layers[start:end]):
            if weights is None or _holds(layer, weights[i]):
                x = layer(x, rotary_freqs)
            else:
                x = functional_call(layer, weights[i], (x, rotary_freqs))
        return x

    def _checkpoint(self, start: int, end: int, x: torch.Tensor, rotary_freqs) -> torch.Tensor:
        """Layers ``start .. end - 1`` keeping only their input; backward recomputes them with
        the tensors this forward used."""
        weights = [_tensors(layer) for layer in self.layers[start:end]]
        return checkpoint(self._run, start, end, x, rotary_freqs, weights)

    def forward(
        self, hidden_states: torch.Tensor, rotary_freqs: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[s, b, h]`` (``[s/tp, b, h]``) in and out."""
        config, n, x = self.config, len(self.layers), hidden_states
        if config.recompute_granularity == "full" and self.training:
            step = config.recompute_num_layers
            if config.recompute_method == "uniform":
                for start in range(0, n, step):
                    x = self._checkpoint(start, min(start + step, n), x, rotary_freqs)
            else:
                for i in range(n):
                    if i < step:
                        x = self._checkpoint(i, i + 1, x, rotary_freqs)
                    else:
                        x = self.layers[i](x, rotary_freqs)
        else:
            x = self._run(0, n, x, rotary_freqs)
        return x if self.final_layernorm is None else self.final_layernorm(x)
