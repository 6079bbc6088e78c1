"""The TP × CP × DP × PP rank grid as pure data.

A ``ProcessGrid`` lays ``world_size`` ranks out on named dimensions. ``order``
lists the dimensions fastest-varying first, so with the default
``"tp-cp-dp-pp"`` (Megatron-Core's order without ep) tensor-parallel neighbours
are consecutive ranks (same node, NVLink), context-parallel ones come next and
the pipeline dimension varies slowest (across nodes).

Context parallel (cp) splits every sequence over its ranks; they hold the same
weights, so gradients are reduced over data × context parallel ranks (the
``dp_cp`` group), while the data loader still feeds ``dp`` distinct batches.

Nothing here touches ``torch.distributed``: every group, coordinate and
neighbour is rank arithmetic and can be tested without processes. A new
dimension takes more than a size in ``dims``: a constructor argument, an entry
in ``DIMENSION_NAMES`` (so every ``order`` names it), its share divided out of
dp in ``__post_init__``, its place in the composite groups and a column in
:meth:`ProcessGrid.describe`. Expert parallel splits the data-parallel ranks
differently for expert layers, so it needs a second grid over the same ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import product

# Groups that span more than one dimension: one model replica (Megatron's model-parallel
# group leaves cp out), tensor × context (Megatron's tensor-and-context group) and
# data × context (where gradients are reduced).
COMPOSITE_GROUPS: dict[str, tuple[str, ...]] = {
    "mp": ("tp", "pp"),
    "tp_cp": ("tp", "cp"),
    "dp_cp": ("dp", "cp"),
}
# Every group kind the grid lays out, and parallel_state creates.
CONTEXT_GROUPS = ("cp", "tp_cp", "dp_cp")
GROUP_NAMES = ("tp", "pp", "dp", "mp", "embedding", "position_embedding", *CONTEXT_GROUPS)
DIMENSION_NAMES = ("tp", "cp", "dp", "pp")


@dataclass(frozen=True)
class ProcessGrid:
    """Rank layout of ``world_size`` ranks over tp × cp × dp × pp.

    Args:
        world_size: total number of ranks.
        tensor_model_parallel_size: ranks that split every layer's matmuls.
        pipeline_model_parallel_size: pipeline stages.
        virtual_pipeline_model_parallel_size: model chunks per pipeline rank
            (interleaved schedule); ``None`` for one chunk.
        order: dimension names joined by ``-``, fastest-varying first; every
            dimension once. An order without ``cp`` (such as the earlier default
            ``"tp-dp-pp"``) is accepted while context_parallel_size is 1: cp is
            inserted right after tp, where it changes no group. ``grid.order``
            is the completed order.
        context_parallel_size: ranks that split every sequence (keyword only).

    The data-parallel size is ``world_size // (tp * cp * pp)``.
    """

    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    order: str = "tp-cp-dp-pp"
    context_parallel_size: int = field(default=1, kw_only=True)
    dims: dict[str, int] = field(init=False, repr=False, compare=False)
    _strides: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        cp = self.context_parallel_size
        vpp = self.virtual_pipeline_model_parallel_size
        for name, value in (
            ("world_size", self.world_size),
            ("tensor_model_parallel_size", tp),
            ("pipeline_model_parallel_size", pp),
            ("context_parallel_size", cp),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.world_size % (tp * cp * pp) != 0:
            # cp is named only where it is used, so the message of a tp × pp layout stays short
            names = ["tensor_model_parallel_size", "pipeline_model_parallel_size"]
            factors = [tp, pp]
            if cp > 1:
                names.insert(1, "context_parallel_size")
                factors.insert(1, cp)
            per_replica = tp * cp * pp
            raise ValueError(
                f"world_size {self.world_size} is not divisible by {' × '.join(names)} "
                f"({' × '.join(map(str, factors))} = {per_replica}); launch a multiple "
                f"of {per_replica} processes or choose sizes whose product divides "
                f"{self.world_size}"
            )
        if vpp is not None:
            if not isinstance(vpp, int) or vpp < 1:
                raise ValueError(
                    f"virtual_pipeline_model_parallel_size must be None or an integer >= 1, "
                    f"got {vpp!r}"
                )
            if pp == 1:
                raise ValueError(
                    f"virtual_pipeline_model_parallel_size {vpp} needs pipeline parallelism, "
                    "but pipeline_model_parallel_size is 1; set pp > 1 or drop the virtual size"
                )
        names = self.order.split("-")
        if "cp" not in names:
            if cp > 1:
                raise ValueError(
                    f"order {self.order!r} does not name cp, but context_parallel_size is {cp}; "
                    "add it, e.g. 'tp-cp-dp-pp'"
                )
            # A size-1 dimension changes no group wherever it sits; next to tp, as Megatron puts it.
            names.insert(names.index("tp") + 1 if "tp" in names else 0, "cp")
        if sorted(names) != sorted(DIMENSION_NAMES):
            unknown = sorted(set(names) - set(DIMENSION_NAMES))
            repeated = sorted({n for n in names if names.count(n) > 1})
            missing = sorted(set(DIMENSION_NAMES) - set(names))
            raise ValueError(
                f"order {self.order!r} must name each of {'/'.join(DIMENSION_NAMES)} exactly "
                f"once (unknown: {unknown}, repeated: {repeated}, missing: {missing}); "
                "e.g. 'tp-cp-dp-pp'"
            )
        sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": self.world_size // (tp * cp * pp)}
        dims = {name: sizes[name] for name in names}
        strides, stride = {}, 1
        for name in names:
            strides[name] = stride
            stride *= dims[name]
        object.__setattr__(self, "order", "-".join(names))
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "_strides", strides)

    # ----- sizes -------------------------------------------------------------
    @property
    def tp(self) -> int:
        return self.dims["tp"]

    @property
    def pp(self) -> int:
        return self.dims["pp"]

    @property
    def dp(self) -> int:
        return self.dims["dp"]

    @property
    def cp(self) -> int:
        return self.dims["cp"]

    @property
    def vpp(self) -> int | None:
        return self.virtual_pipeline_model_parallel_size

    def size(self, name: str) -> int:
        """Number of ranks in one group of kind ``name``."""
        if name in self.dims:
            return self.dims[name]
        if name in COMPOSITE_GROUPS:
            return math.prod(self.dims[d] for d in COMPOSITE_GROUPS[name])
        if name == "embedding":
            return min(self.pp, 2)
        if name == "position_embedding":
            return 1
        raise ValueError(f"unknown group {name!r}; known groups: {', '.join(GROUP_NAMES)}")

    # ----- coordinates ---------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")

    def coords(self, rank: int) -> dict[str, int]:
        """The index of ``rank`` along every dimension, in ``order``, e.g.
        ``{"tp": 1, "cp": 0, "dp": 0, "pp": 3}``."""
        self._check_rank(rank)
        return {name: (rank // self._strides[name]) % size for name, size in self.dims.items()}

    def rank(self, **coords: int) -> int:
        """Inverse of :meth:`coords`: ``grid.rank(tp=1, cp=0, dp=0, pp=3)``."""
        if set(coords) != set(self.dims):
            raise ValueError(f"give one index per dimension {list(self.dims)}, got {coords}")
        for name, index in coords.items():
            if not 0 <= index < self.dims[name]:
                raise ValueError(f"{name} index {index} is outside [0, {self.dims[name]})")
        return sum(index * self._strides[name] for name, index in coords.items())

    # ----- groups --------------------------------------------------------------
    def _groups_along(self, along: tuple[str, ...]) -> list[list[int]]:
        """Ranks that differ only in the dimensions ``along``, one list per fixed rest."""
        fixed = [n for n in self.dims if n not in along]
        varying = [n for n in self.dims if n in along]  # fastest first, as in `order`
        groups = []
        for rest in product(*(range(self.dims[n]) for n in fixed)):
            base = sum(i * self._strides[n] for n, i in zip(fixed, rest, strict=True))
            members = []
            for index in product(*(range(self.dims[n]) for n in reversed(varying))):
                offsets = zip(reversed(varying), index, strict=True)
                members.append(base + sum(i * self._strides[n] for n, i in offsets))
            groups.append(members)
        return sorted(groups)

    def groups(self, name: str) -> list[list[int]]:
        """Every group of kind ``name`` as a sorted list of rank lists.

        ``name`` is one of ``tp``, ``cp``, ``pp``, ``dp``, ``mp`` (tp × pp: one
        copy of the model, for one cp slice of the sequence), ``tp_cp``
        (tp × cp), ``dp_cp`` (dp × cp: the ranks that hold the same weights and
        reduce their gradients), ``embedding`` (first and last stage of each
        pipeline, which share the tied word embedding; one rank when pp = 1) and
        ``position_embedding`` (first stage of each pipeline). A group lists its
        ranks in increasing order; along one dimension, that is the order of
        their coordinate.
        """
        if name in self.dims:
            return self._groups_along((name,))
        if name in COMPOSITE_GROUPS:
            return self._groups_along(COMPOSITE_GROUPS[name])
        if name == "embedding":
            return [sorted({g[0], g[-1]}) for g in self._groups_along(("pp",))]
        if name == "position_embedding":
            return [[g[0]] for g in self._groups_along(("pp",))]
        raise ValueError(f"unknown group {name!r}; known groups: {', '.join(GROUP_NAMES)}")

    def group_of(self, name: str, rank: int) -> list[int]:
        """The group of kind ``name`` that holds ``rank`` (``[]`` if none does)."""
        self._check_rank(rank)
        return next((g for g in self.groups(name) if rank in g), [])

    # ----- pipeline neighbours -------------------------------------------------
    def pipeline_stage(self, rank: int) -> int:
        return self.coords(rank)["pp"]

    def is_first_stage(self, rank: int) -> bool:
        return self.pipeline_stage(rank) == 0

    def is_last_stage(self, rank: int) -> bool:
        return self.pipeline_stage(rank) == self.pp - 1

    def next_pipeline_rank(self, rank: int) -> int:
        """The rank holding the next stage; the last stage wraps to the first
        (the interleaved schedule sends chunk i's output there for chunk i + 1)."""
        return self._pipeline_neighbour(rank, +1)

    def prev_pipeline_rank(self, rank: int) -> int:
        """The rank holding the previous stage; the first stage wraps to the last."""
        return self._pipeline_neighbour(rank, -1)

    def _pipeline_neighbour(self, rank: int, step: int) -> int:
        coords = self.coords(rank)
        coords["pp"] = (coords["pp"] + step) % self.pp
        return self.rank(**coords)

    # ----- display -------------------------------------------------------------
    def describe(self) -> str:
        """A table of every rank's coordinates and groups, for a look before launch."""
        vpp = f", vpp={self.vpp}" if self.vpp else ""
        lines = [
            f"world_size={self.world_size}: tp={self.tp} × cp={self.cp} × dp={self.dp} × "
            f"pp={self.pp}{vpp}, order {self.order} (fastest-varying first)",
        ]
        dims = ("tp", "cp", "dp", "pp")
        header = ["rank", *dims, *(f"{n} group" for n in dims), "embedding"]
        rows = []
        for rank in range(self.world_size):
            c = self.coords(rank)
            groups = (self.group_of(n, rank) for n in (*dims, "embedding"))
            cells = ["-" if not g else ",".join(map(str, g)) for g in groups]
            rows.append([str(rank), *(str(c[n]) for n in dims), *cells])
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
        return "\n".join(lines)
