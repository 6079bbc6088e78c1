"""The TP × CP × DP × PP rank grid, and its expert layout, as pure data.

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
:meth:`ProcessGrid.describe`.

Expert layers (mixture of experts) lay the same ranks out a second time, as
Megatron-Core's expert rank generator does: dimensions expert-tp (``etp``,
default tp), ep and expert-dp (``world / (etp · ep · pp)``) and the same pp,
with no cp (the expert layers see tokens, not sequences). Their order is the
dense order with cp dropped and ep placed just before dp: the default
``tp-cp-dp-pp`` gives ``tp-ep-dp-pp``. The groups ``ep``, ``expt_tp``,
``expt_dp``, ``tp_ep`` and ``tp_ep_pp`` come from :meth:`ProcessGrid.expert_groups`.
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
# The expert layout's groups (Megatron-Core's names) and the expert dimensions each spans:
# experts split over ep, each expert's matrices over expt_tp, copies of one expert over expt_dp;
# tp_ep exchanges tokens, tp_ep_pp holds one copy of every expert of the model.
EXPERT_GROUPS: dict[str, tuple[str, ...]] = {
    "ep": ("ep",),
    "expt_tp": ("expt_tp",),
    "expt_dp": ("expt_dp",),
    "tp_ep": ("expt_tp", "ep"),
    "tp_ep_pp": ("expt_tp", "ep", "pp"),
}
EXPERT_GROUP_NAMES = tuple(EXPERT_GROUPS)
# Megatron-Core's token for each expert dimension (its expert RankGenerator's order).
_EXPERT_TOKENS = {"expt_tp": "tp", "ep": "ep", "expt_dp": "dp", "pp": "pp"}


def _groups_along(
    dims: dict[str, int], strides: dict[str, int], along: tuple[str, ...]
) -> list[list[int]]:
    """Ranks that differ only in the dimensions ``along`` of a layout (``dims`` in order,
    fastest first, with their ``strides``), one sorted list per fixed rest, sorted."""
    fixed = [n for n in dims if n not in along]
    varying = [n for n in dims if n in along]  # fastest first, as in the order

    def offsets(names: list[str]) -> list[int]:
        """Every combination of ``names``' coordinates as a rank offset, the first name
        varying slowest."""
        steps = product(*(range(0, dims[n] * strides[n], strides[n]) for n in names))
        return [sum(step) for step in steps]

    members = offsets(varying[::-1])
    return sorted([base + m for m in members] for base in offsets(fixed))


def _unknown_group(name: str) -> str:
    where = " (an expert group: use expert_groups)" if name in EXPERT_GROUPS else ""
    return f"unknown group {name!r}{where}; known groups: {', '.join(GROUP_NAMES)}"


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
        expert_model_parallel_size: ranks that split the experts of an expert
            layer (ep, keyword only).
        expert_tensor_parallel_size: ranks that split each expert's matrices
            (etp, keyword only); ``None`` means tp, as in Megatron-Core.

    The data-parallel size is ``world_size // (tp * cp * pp)``; the expert
    data-parallel size is ``world_size // (etp * ep * pp)``.
    """

    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    order: str = "tp-cp-dp-pp"
    context_parallel_size: int = field(default=1, kw_only=True)
    expert_model_parallel_size: int = field(default=1, kw_only=True)
    expert_tensor_parallel_size: int | None = field(default=None, kw_only=True)
    dims: dict[str, int] = field(init=False, repr=False, compare=False)
    _strides: dict[str, int] = field(init=False, repr=False, compare=False)
    expert_dims: dict[str, int] = field(init=False, repr=False, compare=False)
    _expert_strides: dict[str, int] = field(init=False, repr=False, compare=False)

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
            # ep has no place in the order: expert layers put it just before dp
            hint = "; ep is placed by the expert layout itself" if "ep" in unknown else ""
            raise ValueError(
                f"order {self.order!r} must name each of {'/'.join(DIMENSION_NAMES)} exactly "
                f"once (unknown: {unknown}, repeated: {repeated}, missing: {missing}); "
                f"e.g. 'tp-cp-dp-pp'{hint}"
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
        self._lay_out_experts()

    def _lay_out_experts(self) -> None:
        """The expert layout: etp × ep × expert-dp × pp over the same ranks (see the module
        docstring), checked as Megatron-Core checks it."""
        ep, etp = self.expert_model_parallel_size, self.expert_tensor_parallel_size
        if etp is None:
            etp = self.tensor_model_parallel_size
            object.__setattr__(self, "expert_tensor_parallel_size", etp)
        for name, value in (
            ("expert_model_parallel_size", ep),
            ("expert_tensor_parallel_size", etp),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        pp = self.pipeline_model_parallel_size
        per_replica = etp * ep * pp
        if self.world_size % per_replica:
            raise ValueError(
                f"world_size {self.world_size} is not divisible by expert_tensor_parallel_size × "
                f"expert_model_parallel_size × pipeline_model_parallel_size ({etp} × {ep} × "
                f"{pp} = {per_replica}); choose expert sizes whose product with pp divides "
                f"{self.world_size}"
            )
        sizes = {"expt_tp": etp, "ep": ep, "expt_dp": self.world_size // per_replica, "pp": pp}
        names = []
        for name in self.order.split("-"):
            if name == "dp":
                names += ["ep", "expt_dp"]  # ep varies just faster than dp, as Megatron's default
            elif name != "cp":
                names.append({"tp": "expt_tp"}.get(name, name))
        dims = {name: sizes[name] for name in names}
        strides, stride = {}, 1
        for name in names:
            strides[name] = stride
            stride *= dims[name]
        object.__setattr__(self, "expert_dims", dims)
        object.__setattr__(self, "_expert_strides", strides)
        if not self.has_expert_layout:
            return  # expert layers, if any, use the dense groups (parallel_state)
        if pp > 1 and not self.order.endswith("pp") and self.edp != self.dp:
            raise ValueError(
                f"with order {self.order!r} (pp not last) the expert layers need the same "
                f"data-parallel size as the others, but expert dp is {self.edp} and dp is "
                f"{self.dp}; put pp last in the order or choose etp × ep = tp × cp"
            )
        if self._groups_along(("pp",)) != _groups_along(dims, strides, ("pp",)):
            raise ValueError(
                f"with order {self.order!r} the expert layers' pipeline groups differ from the "
                "others' (etp × ep differs from tp × cp before pp); put pp last in the order"
            )

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

    @property
    def ep(self) -> int:
        return self.expert_dims["ep"]

    @property
    def etp(self) -> int:
        return self.expert_dims["expt_tp"]

    @property
    def edp(self) -> int:
        """The expert data-parallel size, ``world_size // (etp * ep * pp)``."""
        return self.expert_dims["expt_dp"]

    @property
    def expert_order(self) -> str:
        """The expert layout's order in Megatron-Core's tokens (tp = etp, dp = expert dp),
        fastest-varying first, e.g. ``"tp-ep-dp-pp"``."""
        return "-".join(_EXPERT_TOKENS[name] for name in self.expert_dims)

    @property
    def has_expert_layout(self) -> bool:
        """Whether expert layers are laid out unlike the others (ep > 1 or etp ≠ tp)."""
        return self.ep > 1 or self.etp != self.tp

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
        raise ValueError(_unknown_group(name))

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
        return _groups_along(self.dims, self._strides, along)

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
        raise ValueError(_unknown_group(name))

    def group_of(self, name: str, rank: int) -> list[int]:
        """The group of kind ``name`` that holds ``rank`` (``[]`` if none does)."""
        self._check_rank(rank)
        return next((g for g in self.groups(name) if rank in g), [])

    # ----- the expert layout ----------------------------------------------------
    def expert_size(self, name: str) -> int:
        """Number of ranks in one expert group of kind ``name``."""
        return math.prod(self.expert_dims[d] for d in self._expert_along(name))

    def expert_coords(self, rank: int) -> dict[str, int]:
        """The index of ``rank`` along every expert dimension, in the expert order, e.g.
        ``{"expt_tp": 0, "ep": 1, "expt_dp": 0, "pp": 0}``."""
        self._check_rank(rank)
        return {
            name: (rank // self._expert_strides[name]) % size
            for name, size in self.expert_dims.items()
        }

    def expert_groups(self, name: str) -> list[list[int]]:
        """Every expert group of kind ``name`` as a sorted list of rank lists.

        ``name`` is one of ``ep`` (ranks that hold different experts and exchange tokens
        for them), ``expt_tp`` (ranks that split each expert's matrices), ``expt_dp``
        (ranks that hold the same experts and reduce their gradients), ``tp_ep``
        (expt_tp × ep: every rank a token may go to) and ``tp_ep_pp`` (tp_ep × pp: one
        copy of every expert in the model). These are Megatron-Core's expert groups
        (its ``get_ranks('ep')``, ``'tp'``, ``'dp'``, ``'tp-ep'`` and ``'tp-ep-pp'`` of the
        expert rank generator).
        """
        return _groups_along(self.expert_dims, self._expert_strides, self._expert_along(name))

    def expert_group_of(self, name: str, rank: int) -> list[int]:
        """The expert group of kind ``name`` that holds ``rank``."""
        self._check_rank(rank)
        return next(g for g in self.expert_groups(name) if rank in g)

    def _expert_along(self, name: str) -> tuple[str, ...]:
        if name not in EXPERT_GROUPS:
            raise ValueError(
                f"unknown expert group {name!r}; known expert groups: "
                f"{', '.join(EXPERT_GROUP_NAMES)}"
            )
        return EXPERT_GROUPS[name]

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
        """A table of every rank's coordinates and groups, for a look before launch; with an
        expert layout (ep > 1 or etp ≠ tp) also its ep coordinate and expert groups."""
        vpp = f", vpp={self.vpp}" if self.vpp else ""
        lines = [
            f"world_size={self.world_size}: tp={self.tp} × cp={self.cp} × dp={self.dp} × "
            f"pp={self.pp}{vpp}, order {self.order} (fastest-varying first)",
        ]
        experts = ("ep", "expt_tp", "expt_dp") if self.has_expert_layout else ()
        if experts:
            lines.append(
                f"expert layers: etp={self.etp} × ep={self.ep} × expert dp={self.edp} × "
                f"pp={self.pp}, order {self.expert_order}"
            )
        dims = ("tp", "cp", "dp", "pp")
        header = ["rank", *dims, *(f"{n} group" for n in dims), "embedding"]
        header += [n for n in experts if n == "ep"] + [f"{n} group" for n in experts]
        rows = []
        for rank in range(self.world_size):
            c = self.coords(rank)
            groups = (self.group_of(n, rank) for n in (*dims, "embedding"))
            cells = ["-" if not g else ",".join(map(str, g)) for g in groups]
            row = [str(rank), *(str(c[n]) for n in dims), *cells]
            if experts:
                row.append(str(self.expert_coords(rank)["ep"]))
                row += [",".join(map(str, self.expert_group_of(n, rank))) for n in experts]
            rows.append(row)
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
        return "\n".join(lines)
