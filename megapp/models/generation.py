"""Text generation from a whole GPTModel (tensor-parallel or not) with a key/value cache.

:class:`KVCache` installs one store per attention layer: the prompt runs once (prefill),
then every step feeds one token per sequence and attends to the keys and values kept so
far, at its own position (learned positions and RoPE both offset). Sampling is greedy,
or temperature with optional top-k and top-p (nucleus) filtering, from a generator
seeded alike on every tensor-parallel rank, so all ranks pick the same tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megapp import comm
from megapp.models.gpt import GPTModel
from megapp.transformer.layer import ParallelAttention, merge_heads


class LayerCache:
    """The keys and values one attention layer has seen, ``[b, groups/tp, t, d]``."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def attend(
        self, attention: ParallelAttention, x: torch.Tensor, rotary_freqs: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``attention``'s forward for new tokens ``x`` ``[s, b, h]`` after the cached ones."""
        q, k, v = attention.qkv(x, rotary_freqs)
        past = 0 if self.keys is None else self.keys.shape[2]
        self.keys = k if self.keys is None else torch.cat((self.keys, k), dim=2)
        self.values = v if self.values is None else torch.cat((self.values, v), dim=2)
        keys, values = self.keys, self.values
        groups = q.shape[1] // keys.shape[1]
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
        s = q.shape[2]
        # New token i sits at position past + i and sees keys 0 .. past + i.
        mask = torch.ones(s, past + s, dtype=torch.bool, device=q.device).tril(past)
        context = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return attention.linear_proj(merge_heads(context))


class KVCache:
    """Per-layer caches for ``model`` (a whole model: embedding, every layer, output)."""

    def __init__(self, model: GPTModel) -> None:
        if not (model.pre_process and model.post_process):
            raise ValueError("generation needs the whole model in one chunk (no pipeline)")
        if model.config.sequence_parallel:
            raise ValueError("generation runs without sequence parallelism")
        self.model = model
        self.layers = [LayerCache() for _ in model.decoder.layers]
        self.length = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        attentions = [layer.self_attention for layer in self.model.decoder.layers]
        for attention, cache in zip(attentions, self.layers, strict=True):
            attention.kv_cache = cache
        try:
            yield
        finally:
            for attention in attentions:
                attention.kv_cache = None

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[b, V]`` of the last of ``tokens`` ``[b, s]``, which follow
        the cached ones."""
        model, s = self.model, tokens.shape[1]
        positions = torch.arange(self.length, self.length + s, device=tokens.device)
        with self.installed():
            shard = model(tokens, positions.expand_as(tokens), rotary_offset=self.length)
        self.length += s
        last = shard[:, -1, :]  # [b, V_pad/tp]
        tp = comm.world_size(model.tp_group)
        if tp > 1:
            whole = last.new_empty(tp * last.shape[1], last.shape[0])
            comm.all_gather_into(whole, last.t().contiguous(), model.tp_group)
            last = whole.t()
        return last[:, : model.config.vocab_size].float()


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy, or softmax(logits / temperature) restricted to
    the ``top_k`` most likely tokens and to the smallest set whose probability reaches
    ``top_p``."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature <= 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                "sampling needs temperature > 0, top_k >= 0 and 0 < top_p <= 1, got "
                f"{self.temperature}, {self.top_k}, {self.top_p}"
            )

    def choose(self, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The next token ``[b]`` from logits ``[b, V]``."""
        if self.greedy:
            return logits.argmax(dim=-1)
        logits = logits / self.temperature
        if self.top_k:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            ordered, order = logits.sort(dim=-1, descending=True)
            before = ordered.softmax(dim=-1).cumsum(dim=-1) - ordered.softmax(dim=-1)
            ordered = ordered.masked_fill(before >= self.top_p, float("-inf"))  # keeps the top
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
        probs = logits.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def generate(
    model: GPTModel,
    prompt: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    seed: int = 0,
    eod: int | None = None,
) -> torch.Tensor:
    """``prompt`` ``[b, s]`` followed by up to ``max_new_tokens`` generated tokens; a
    sequence stops growing after ``eod`` (the others go on; finished ones repeat it)."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    limit = model.config.max_position_embeddings
    if model.config.position_embedding_type == "learned_absolute" and (
        prompt.shape[1] + max_new_tokens > limit
    ):
        raise ValueError(f"prompt + new tokens exceed max_position_embeddings ({limit})")
    was_training = model.training
    model.eval()
    cache = KVCache(model)
    generator = torch.Generator(device=prompt.device).manual_seed(seed)
    out, done = prompt, torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    step = prompt
    try:
        for _ in range(max_new_tokens):
            token = sampling.choose(cache.logits(step), generator)
            if eod is not None:
                token = torch.where(done, torch.full_like(token, eod), token)
                done = done | (token == eod)
            out = torch.cat((out, token[:, None]), dim=1)
            step = token[:, None]
            if eod is not None and bool(done.all()):
                break
    finally:
        model.train(was_training)
    return out
