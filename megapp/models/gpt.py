"""GPT: vocab-parallel embedding, a transformer block, a tied output layer, vocab-parallel loss.

A :class:`GPTModel` is one pipeline chunk: it holds the embedding when it is the
first virtual stage (``pre_process``), the final norm and output layer when it is
the last (``post_process``), and a contiguous slice of the layers. With one
chunk holding everything it is the whole single-process model.

Every part is initialized from its own seed (``seed + k`` for the word embedding,
the positions, the untied output layer and layer ``l``), and tensor-parallel
weights are cut from the full weight, so the same seed gives the same model
under every (tp, pp, vpp) layout.

The output layer reuses the word embedding (``share_embeddings_and_output_weights``).
When the last stage is another rank it holds its own copy, initialized from the
same seed; after backward the two gradients are summed over the embedding group
(first and last stage) so the copies stay equal. Both carry
``shared_embedding = True``; the copy also carries ``shared = True`` so norms
count it once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megapp import comm
from megapp.comm import Group
from megapp.context_parallel.layout import positions, split
from megapp.fusions.rope import rotary_freqs
from megapp.param_attributes import mark_tied_embedding
from megapp.pipeline_parallel.catalog import default_schedule, schedule_placement
from megapp.pipeline_parallel.engine import mark_chunk_stage
from megapp.pipeline_parallel.partition import split_layers, stage_layer_ranges
from megapp.pipeline_parallel.schedules import Schedule
from megapp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megapp.tensor_parallel.layers import (
    VocabParallelEmbedding,
    column_parallel_matmul,
    init_method_normal,
    sliced_weight,
)
from megapp.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from megapp.tensor_parallel.random import get_rng_tracker
from megapp.tensor_parallel.utils import pad_vocab_size
from megapp.transformer.block import TransformerBlock
from megapp.transformer.config import ExpertGroups, TransformerConfig

# Offsets of each part's initialization seed from the model seed.
_WORD_SEED, _POSITION_SEED, _OUTPUT_SEED, _LAYER_SEED = 0, 1, 2, 3


@dataclass(kw_only=True)
class GPTConfig(TransformerConfig):
    vocab_size: int
    """The tokenizer's vocabulary size; ids ``>= vocab_size`` never occur. It alone fixes the
    model's shape: checkpoints hold these rows whatever the layout."""
    make_vocab_size_divisible_by: int = 1
    """Pad the embedding and output layer to a multiple of this × the tensor-parallel size
    (Megatron's flag; 128 makes GEMM-friendly shapes). Padded rows are zero, never predicted
    (the loss leaves them out) and never saved, so the padding may differ per layout."""
    max_position_embeddings: int = 2048
    """Longest sequence the learned absolute positions cover."""
    share_embeddings_and_output_weights: bool = True
    """Tie the output layer to the word embedding (Megatron's default)."""
    num_layers_in_first_pipeline_stage: int | None = None
    """Layers of the first pipeline rank, split evenly over its chunks; the ranks without
    a count given split the rest evenly (Megatron-Core's uneven split; checked where the
    model is split, :func:`~megapp.pipeline_parallel.partition.rank_layer_counts`). A
    layout, like the tensor-parallel size: with one pipeline stage it does not apply."""
    num_layers_in_last_pipeline_stage: int | None = None
    """Layers of the last pipeline rank, as ``num_layers_in_first_pipeline_stage``."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as one layer where the layers split over the virtual stages:
    the first virtual stage holds one transformer layer fewer (none where the stages
    hold one each); :func:`~megapp.pipeline_parallel.partition.counted_stage_sizes`. A
    layout, as the counts above."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the output layer and the loss as one layer: the last virtual stage holds one
    transformer layer fewer."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError(
                "make_vocab_size_divisible_by must be >= 1, got "
                f"{self.make_vocab_size_divisible_by}"
            )
        if self.max_position_embeddings < 1:
            raise ValueError(
                f"max_position_embeddings must be >= 1, got {self.max_position_embeddings}"
            )

    @property
    def padded_vocab_size(self) -> int:
        """The rows of the embedding and the output layer: ``vocab_size`` padded to a multiple
        of ``make_vocab_size_divisible_by × tensor_model_parallel_size``."""
        return pad_vocab_size(
            self.vocab_size, self.tensor_model_parallel_size, self.make_vocab_size_divisible_by
        )


def gpt_config_from_saved(fields: dict, **overrides) -> GPTConfig:
    """A :class:`GPTConfig` from the plain fields a checkpoint recorded (its dtype a
    string), with ``overrides`` (e.g. the layout of the process reading it)."""
    fields = {**fields, **overrides}
    dtype = fields.get("params_dtype")
    if isinstance(dtype, str):
        fields["params_dtype"] = getattr(torch, dtype.removeprefix("torch."))
    return GPTConfig(**fields)


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class GPTEmbedding(nn.Module):
    """Word (vocab-parallel) plus learned position embeddings, then dropout.

    Ids ``[b, s]`` in, ``[s, b, h]`` out (``[s/tp, b, h]`` with sequence parallelism).
    """

    def __init__(self, config: GPTConfig, tp_group: Group, seed: int):
        super().__init__()
        self.config, self.tp_group = config, tp_group
        init = init_method_normal(config.init_method_std)
        with _seeded(seed + _WORD_SEED):
            self.word_embeddings = VocabParallelEmbedding(
                config.vocab_size,
                config.hidden_size,
                init_method=init,
                sequence_parallel=config.sequence_parallel,
                tp_group=tp_group,
                params_dtype=config.params_dtype,
                make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
            )
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            with _seeded(seed + _POSITION_SEED):
                weight = init(torch.empty(config.max_position_embeddings, config.hidden_size))
            self.position_embeddings = nn.Embedding.from_pretrained(
                weight.to(config.params_dtype), freeze=False
            )

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        config = self.config
        seq = input_ids.shape[1]
        if seq > config.max_position_embeddings and self.position_embeddings is not None:
            raise ValueError(
                f"sequence length {seq} exceeds max_position_embeddings "
                f"({config.max_position_embeddings})"
            )
        x = self.word_embeddings(input_ids.t())  # [s, b, h] or [s/tp, b, h]
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(seq, device=input_ids.device).expand_as(input_ids)
            positions = self.position_embeddings(position_ids.t())
            if config.sequence_parallel:
                # Backward all-gathers, so every rank's position gradient is complete.
                positions = scatter_to_sequence_parallel_region(positions, self.tp_group)
            x = x + positions
        if config.hidden_dropout and self.training:
            # Sequence-parallel ranks hold different tokens: each draws its own mask.
            own = config.sequence_parallel
            with get_rng_tracker().fork() if own else contextlib.nullcontext():
                x = nn.functional.dropout(x, config.hidden_dropout)
        return x


class GPTModel(nn.Module):
    """One pipeline chunk of a GPT (the whole model by default).

    forward(input_ids [b, s] | None, position_ids [b, s] | None, hidden_states, labels [b, s],
            rotary_offset)
      - ``pre_process``: reads ``input_ids``; otherwise ``hidden_states`` ``[s, b, h]``
        (``[s/tp, b, h]``) from the previous stage.
      - not ``post_process``: returns the hidden states for the next stage.
      - ``post_process``: returns the per-token loss ``[b, s]`` (fp32) when ``labels`` are
        given, else the logits shard ``[b, s, V_pad/tp]``.
      - ``rotary_offset``: the position of the first token for RoPE (generation with a
        key/value cache feeds tokens after the first).

    ``expert_groups``: the groups of the mixture-of-experts layers (``config.num_moe_experts``),
    :class:`~megapp.transformer.config.ExpertGroups`.
    """

    def __init__(
        self,
        config: GPTConfig,
        *,
        pre_process: bool = True,
        post_process: bool = True,
        first_layer: int = 0,
        num_layers: int | None = None,
        tp_group: Group = None,
        seed: int = 1234,
        cp_group: Group = None,
        expert_groups: ExpertGroups | None = None,
    ):
        super().__init__()
        if comm.world_size(tp_group) != config.tensor_model_parallel_size:
            raise ValueError(
                f"config.tensor_model_parallel_size is {config.tensor_model_parallel_size} but "
                f"the tensor-parallel group has {comm.world_size(tp_group)} ranks"
            )
        self.config, self.tp_group = config, tp_group
        self.cp_group = cp_group if config.context_parallel_size > 1 else None
        self.pre_process, self.post_process = pre_process, post_process
        self.embedding = GPTEmbedding(config, tp_group, seed) if pre_process else None
        self.decoder = TransformerBlock(
            config,
            first_layer=first_layer,
            num_layers=num_layers,
            post_layer_norm=post_process,
            tp_group=tp_group,
            init_seed=seed + _LAYER_SEED,
            cp_group=cp_group,
            expert_groups=expert_groups,
        )
        self.output_weight = None
        if post_process:
            tied = config.share_embeddings_and_output_weights
            if not tied or not pre_process:
                with _seeded(seed + (_WORD_SEED if tied else _OUTPUT_SEED)):
                    self.output_weight = sliced_weight(
                        (config.vocab_size, config.hidden_size),
                        0,
                        tp_group,
                        init_method_normal(config.init_method_std),
                        config.params_dtype,
                        None,
                        padded_rows=config.padded_vocab_size - config.vocab_size,
                    )
            if tied and not pre_process:  # a copy of the first stage's word embedding
                mark_tied_embedding(self.output_weight, duplicate=True)
        if pre_process and not post_process and config.share_embeddings_and_output_weights:
            mark_tied_embedding(self.embedding.word_embeddings.weight, duplicate=False)
        self._freqs: torch.Tensor | None = None
        self._cp_freqs: torch.Tensor | None = None

    def shared_embedding_or_output_weight(self) -> nn.Parameter | None:
        """The weight the output layer multiplies with (the word embedding when tied)."""
        if self.output_weight is not None:
            return self.output_weight
        if self.post_process:
            return self.embedding.word_embeddings.weight
        return None

    def _rotary(self, seq: int, device: torch.device, offset: int = 0) -> torch.Tensor | None:
        """Rotary frequencies ``[seq, 1, 1, rot_dim]`` of positions ``offset ..``; under
        context parallelism, of the global positions of this rank's ``seq`` tokens."""
        config = self.config
        if config.position_embedding_type != "rope":
            return None
        cp = config.context_parallel_size
        if cp > 1 and offset:
            raise ValueError("generation (a key/value cache) does not run with context parallelism")
        whole = offset + seq * cp
        if self._freqs is None or self._freqs.shape[0] < whole or self._freqs.device != device:
            self._freqs = rotary_freqs(
                whole, config.rotary_dim, config.rotary_base, device, config.rope_scaling
            )
        if cp > 1:  # this rank's rows, picked once per sequence length, not per microbatch
            cached = self._cp_freqs
            if cached is None or cached.shape[0] != seq or cached.device != device:
                self._cp_freqs = split(self._freqs[:whole], cp, comm.rank(self.cp_group))
            return self._cp_freqs
        return self._freqs[offset:whole]

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        rotary_offset: int = 0,
    ) -> torch.Tensor:
        config = self.config
        if self.pre_process:
            if input_ids is None:
                raise ValueError("the first pipeline stage needs input_ids [b, s]")
            if position_ids is None and self.cp_group is not None:
                cp = config.context_parallel_size
                seq = input_ids.shape[1] * cp
                ids = positions(seq, cp, comm.rank(self.cp_group), input_ids.device)
                position_ids = ids.expand_as(input_ids)
            hidden_states = self.embedding(input_ids, position_ids)
        elif hidden_states is None:
            raise ValueError("a pipeline chunk without the embedding needs hidden_states")
        tp = config.tensor_model_parallel_size
        seq = hidden_states.shape[0] * (tp if config.sequence_parallel else 1)
        freqs = self._rotary(seq, hidden_states.device, rotary_offset)
        hidden_states = self.decoder(hidden_states, freqs)
        if not self.post_process:
            return hidden_states
        logits = column_parallel_matmul(
            hidden_states,
            self.shared_embedding_or_output_weight(),
            None,
            self.tp_group,
            config.sequence_parallel,
        )  # [s, b, V_pad/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = vocab_parallel_cross_entropy(
            logits, labels.t(), tp_group=self.tp_group, vocab_size=config.vocab_size
        )
        return loss.t().contiguous()


def build_gpt_chunks(
    config: GPTConfig,
    *,
    pp_rank: int = 0,
    pp_size: int = 1,
    vpp_size: int | None = None,
    tp_group: Group = None,
    seed: int = 1234,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    schedule: str | Schedule | None = None,
    stages: Sequence[int] | None = None,
    cp_group: Group = None,
    expert_groups: ExpertGroups | None = None,
) -> list[GPTModel]:
    """This pipeline rank's model chunks: chunk ``c`` is the virtual stage ``schedule``
    (a name or a :class:`~megapp.pipeline_parallel.schedules.Schedule`) places there,
    ``c·pp + pp_rank`` for the looped schedules (the default); a V puts the first and
    last stage on rank 0. ``stages``: this rank's virtual stages given directly instead.
    Each chunk records its stage, and the whole placement where it is known, for the
    engine to check (:func:`~megapp.pipeline_parallel.engine.check_chunk_stages`).

    Layers split evenly over the ``pp × vpp`` virtual stages, which must divide
    ``num_layers`` (Megatron's rule), unless the first and/or last pipeline rank's count
    is given (``config.num_layers_in_first_pipeline_stage`` / ``..._last_...``, or
    ``first_stage_layers`` / ``last_stage_layers`` here, which win): then the other
    ranks split the rest evenly, and every rank's layers split evenly over its chunks
    (:func:`~megapp.pipeline_parallel.partition.stage_layer_ranges`); or with the embedding
    and/or the loss counted as a layer (``config.account_for_..._in_pipeline_split``), where
    the first or the last chunk may hold no transformer layer.
    """
    v = vpp_size or 1
    if pp_size < 1 or v < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"bad pipeline position: rank {pp_rank} of {pp_size}, vpp {vpp_size}")
    placement = _placement(schedule, stages, pp_size, v)
    if stages is None:
        stages = placement[pp_rank]
    elif len(stages) != v or not all(0 <= s < pp_size * v for s in stages):
        raise ValueError(f"stages must name {v} virtual stages below {pp_size * v}, got {stages}")
    first = config.num_layers_in_first_pipeline_stage
    last = config.num_layers_in_last_pipeline_stage
    first = first if first_stage_layers is None else first_stage_layers
    last = last if last_stage_layers is None else last_stage_layers
    if pp_size == 1:  # one stage holds every layer: there is no first or last to size
        first = last = None
    uneven = first is not None or last is not None
    if uneven and placement is None and list(stages) != [c * pp_size + pp_rank for c in range(v)]:
        raise ValueError(
            "uneven first/last stages size the stages by the rank that runs them: give "
            "schedule= (the whole placement) instead of stages="
        )
    ranges = stage_layer_ranges(
        config.num_layers,
        pp_size,
        vpp_size,
        first=first,
        last=last,
        placement=placement,
        embedding=config.account_for_embedding_in_pipeline_split,
        loss=config.account_for_loss_in_pipeline_split,
    )
    chunks = []
    for stage in stages:
        layers = ranges[stage]
        chunk = GPTModel(
            config,
            pre_process=stage == 0,
            post_process=stage == pp_size * v - 1,
            first_layer=layers.start,
            num_layers=len(layers),
            tp_group=tp_group,
            seed=seed,
            cp_group=cp_group,
            expert_groups=expert_groups,
        )
        mark_chunk_stage(chunk, stage, placement)
        chunks.append(chunk)
    return chunks


def placement_layer_ranges(gpt: GPTConfig, placement: Sequence[Sequence[int]]) -> list[range]:
    """The layers of every virtual stage of ``placement`` (``[rank][chunk]``) as the
    model is split: even, with the first and last pipeline ranks' counts the config gives,
    or with the embedding and the loss counted as layers. Unlike :func:`build_gpt_chunks`
    it does not check that even stages divide the layers (a planner prices layouts before
    checking them): they differ by one layer at most."""
    p, v = len(placement), len(placement[0])
    first = gpt.num_layers_in_first_pipeline_stage if p > 1 else None
    last = gpt.num_layers_in_last_pipeline_stage if p > 1 else None
    embedding = gpt.account_for_embedding_in_pipeline_split
    loss = gpt.account_for_loss_in_pipeline_split
    if (first, last, embedding, loss) == (None, None, False, False):
        return split_layers(gpt.num_layers, p * v)
    return stage_layer_ranges(
        gpt.num_layers,
        p,
        v,
        first=first,
        last=last,
        placement=placement,
        embedding=embedding,
        loss=loss,
    )


def _placement(
    schedule: str | Schedule | None, stages: Sequence[int] | None, pp: int, v: int
) -> tuple[tuple[int, ...], ...] | None:
    """The whole pipeline's placement: the schedule's, the looped one by default, None
    when only this rank's ``stages`` are given."""
    if schedule is not None and stages is not None:
        raise ValueError("give schedule= or stages=, not both: the schedule places the stages")
    if stages is not None:
        return None
    if isinstance(schedule, Schedule):
        if (schedule.num_stages, schedule.num_chunks) != (pp, v):
            raise ValueError(
                f"{schedule.name} is for {schedule.num_stages} pipeline stages × "
                f"{schedule.num_chunks} chunks, the model for {pp} × {v}"
            )
        return schedule.placement
    return schedule_placement(schedule or default_schedule(v), pp, v)
