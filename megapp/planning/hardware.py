"""A machine as the time model sees it: how fast one device computes and moves bytes, and
how fast the links between devices are.

:class:`Hardware` holds every constant :func:`~megapp.planning.timing.predict_step_time`
reads. Three built-in profiles describe NVIDIA HGX/DGX nodes (8 GPUs on NVLink, one
InfiniBand NIC per GPU); :func:`load_hardware` returns one by name or reads a JSON profile.
A CPU machine whose processes share its cores is described apart, by
:mod:`megapp.planning.shared_cores`, which also measures one (``megapp.plan --calibrate``).

Where the built-in numbers come from (all rates in bytes or FLOPs per second, 10^n, not 2^n):

- ``peak_flops``: the dense 16-bit tensor-core peak of :data:`~megapp.training.flops.GPU_PEAKS`
  (vendor data sheets). MFU is model FLOPs over this.
- ``gemm_flops``: what a transformer layer sustains, norms, softmax and other memory-bound
  work included, as a fraction of that peak. A100: 0.68 of 312 TFLOP/s. Megatron-LM ran
  GPT models on A100s at 52% of peak with full recompute counted (Narayanan et al. 2021,
  "Efficient Large-Scale Language Model Training on GPU Clusters") and at 54-56% MFU with
  selective recompute and sequence parallelism (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models"), both after pipeline bubbles and
  exposed communication, so the layers themselves ran at roughly two thirds of peak.
  H100/H200: 0.60 of 989 TFLOP/s; Megatron-LM's README reports up to 47% MFU on H100
  clusters, and Hopper's larger peak is further from what memory-bound kernels allow. These
  are estimates for ranking layouts; a calibrated profile replaces them with measurements.
- ``memory_bandwidth``: 0.9 of the data sheet's HBM bandwidth (STREAM-style copies reach
  about 92% on an H100 SXM: 3.09 of 3.35 TB/s).
- ``memory_bytes``: the device's total memory as the driver reports it (nvidia-smi:
  81559 MiB for H100 SXM, 143771 MiB for H200 SXM, 81920 MiB for A100 80GB); the planner
  keeps ``usable_fraction`` of it for the job (the rest: CUDA context, NCCL buffers,
  allocator fragmentation).
- ``intra_node_bandwidth``: the bus bandwidth of a ring collective over NVLink per GPU and
  direction. NVLink 4 (H100, H200) is 450 GB/s per direction, NVLink 3 (A100) 300 GB/s;
  nccl-tests all-reduce reaches about 80% of it on DGX nodes: 360 and 240 GB/s.
- ``inter_node_bandwidth``: one InfiniBand NIC per GPU, 90% of line rate: NDR 400 Gb/s
  (H100/H200 DGX) gives 45 GB/s, HDR 200 Gb/s (A100 DGX) 22.5 GB/s.
- latencies: per ring step (one hop of a collective, or one point-to-point message): 3 µs
  over NVLink, 6 µs over InfiniBand (NCCL's small-message times).

``h100-ops``, ``h200-ops`` and ``a100-ops`` are the same devices with operation rates
(:mod:`megapp.planning.op_profiles`, derived from one measured H200): their layers are
priced operation by operation instead of FLOPs at ``gemm_flops``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from megapp.planning.op_profiles import op_rates as derived_op_rates
from megapp.planning.operations import OpRates
from megapp.training.flops import GPU_PEAKS


@dataclass(frozen=True)
class Hardware:
    """One device type and its network. Rates per second, sizes in bytes, times in seconds."""

    name: str
    gemm_flops: float  # sustained FLOP/s of a layer's arithmetic on one device
    peak_flops: float | None  # vendor dense peak for MFU; None where there is none (a CPU)
    memory_bytes: float  # device memory
    memory_bandwidth: float  # device memory bytes/s (the optimizer step is bound by it)
    gpus_per_node: int
    intra_node_bandwidth: float  # bus bandwidth of a collective inside a node, per device
    intra_node_latency: float  # per ring step or message inside a node
    inter_node_bandwidth: float  # per device, between nodes
    inter_node_latency: float  # per ring step or message between nodes
    layer_overhead: float = 0.0  # fixed time per layer per pipeline action (launches, Python)
    action_overhead: float = 0.0  # fixed time per pipeline action (the engine's own work)
    step_overhead: float = 0.0  # fixed time per iteration outside the pipeline
    usable_fraction: float = 0.9  # share of memory_bytes a job may fill
    overlap_communication: bool = True  # collectives run beside compute (NCCL streams)
    transport: str = "nccl"  # point-to-point rules of the pipeline's messages: nccl or gloo
    # the busiest expert rank's routed rows over the balanced share (1.0: balanced); it
    # scales the experts' compute and the all-to-alls of mixture-of-experts layers
    moe_load_imbalance: float = 1.0
    # per-operation rates (megapp.planning.operations); None prices FLOPs at gemm_flops
    ops: OpRates | None = None

    def __post_init__(self) -> None:
        if self.transport not in ("nccl", "gloo"):
            raise ValueError(f"hardware {self.name!r}: transport must be nccl or gloo")
        for name in ("gemm_flops", "memory_bytes", "memory_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hardware {self.name!r}: {name} must be > 0")
        for name in ("intra_node_bandwidth", "inter_node_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hardware {self.name!r}: {name} must be > 0")
        if self.gpus_per_node < 1:
            raise ValueError(f"hardware {self.name!r}: gpus_per_node must be >= 1")
        if self.moe_load_imbalance < 1:
            raise ValueError(f"hardware {self.name!r}: moe_load_imbalance must be >= 1")
        if not 0 < self.usable_fraction <= 1:
            raise ValueError(f"hardware {self.name!r}: usable_fraction must be in (0, 1]")

    @property
    def usable_memory(self) -> float:
        """Bytes a job's ranks may hold on one device."""
        return self.memory_bytes * self.usable_fraction

    def with_gpus_per_node(self, gpus_per_node: int) -> Hardware:
        """The same devices in nodes of ``gpus_per_node``."""
        return dataclasses.replace(self, gpus_per_node=gpus_per_node)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_json(cls, text: str) -> Hardware:
        """Read :meth:`to_json`'s output; a missing or unknown key fails naming it."""
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict) -> Hardware:
        """A profile from its fields by name; a missing or unknown key fails naming it."""
        if not isinstance(data, dict):
            raise ValueError("a hardware profile is a JSON object of its fields")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"unknown hardware keys: {', '.join(unknown)}")
        required = {
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"hardware profile lacks: {', '.join(missing)}")
        if isinstance(data.get("ops"), dict):
            data = {**data, "ops": OpRates.from_dict(data["ops"])}
        return cls(**data)


def _peak(part: str) -> float:
    row = next(r for r in GPU_PEAKS if r.part == part)
    return row.dense_16bit_tflops * 1e12


def _hbm(part: str) -> float:
    row = next(r for r in GPU_PEAKS if r.part == part)
    assert row.hbm_tbps is not None  # the three parts below have one figure
    return row.hbm_tbps * 1e12


_MIB = 2**20

_H100 = Hardware(
    name="h100",
    gemm_flops=0.60 * _peak("H100 SXM"),
    peak_flops=_peak("H100 SXM"),
    memory_bytes=81559 * _MIB,
    memory_bandwidth=0.9 * _hbm("H100 SXM"),
    gpus_per_node=8,
    intra_node_bandwidth=360e9,
    intra_node_latency=3e-6,
    inter_node_bandwidth=45e9,
    inter_node_latency=6e-6,
)

PROFILES: dict[str, Hardware] = {
    "h100": _H100,
    # the H100's node and network with the H200's memory and bandwidth
    "h200": dataclasses.replace(
        _H100,
        name="h200",
        gemm_flops=0.60 * _peak("H200 SXM"),
        peak_flops=_peak("H200 SXM"),
        memory_bytes=143771 * _MIB,
        memory_bandwidth=0.9 * _hbm("H200 SXM"),
    ),
    "a100": Hardware(
        name="a100",
        gemm_flops=0.68 * _peak("A100 80GB SXM"),
        peak_flops=_peak("A100 80GB SXM"),
        memory_bytes=81920 * _MIB,
        memory_bandwidth=0.9 * _hbm("A100 80GB SXM"),
        gpus_per_node=8,
        intra_node_bandwidth=240e9,
        intra_node_latency=3e-6,
        inter_node_bandwidth=22.5e9,
        inter_node_latency=6e-6,
    ),
}
"""Built-in profiles by name (HGX/DGX SXM nodes of 8 GPUs)."""
for _part in ("h100", "h200", "a100"):  # the same devices priced operation by operation
    PROFILES[f"{_part}-ops"] = dataclasses.replace(
        PROFILES[_part], name=f"{_part}-ops", ops=derived_op_rates(_part)
    )


def load_hardware(name_or_path: str) -> Hardware:
    """A built-in profile by name (:data:`PROFILES`), or a JSON profile from a file
    (:meth:`Hardware.save` writes one). Raises ValueError in one line for anything else."""
    key = name_or_path.lower()
    if key in PROFILES:
        return PROFILES[key]
    path = Path(name_or_path)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ValueError(f"no hardware profile at {name_or_path}")
        try:
            return Hardware.from_json(path.read_text())
        except (json.JSONDecodeError, TypeError) as error:
            raise ValueError(f"{name_or_path} is not a hardware profile: {error}") from None
    raise ValueError(
        f"unknown hardware {name_or_path!r}; choose one of {', '.join(PROFILES)} "
        "or give a JSON profile (--calibrate writes one)"
    )


@dataclass(frozen=True)
class Link:
    """One device's share of a network: bus bandwidth (bytes/s) and latency per ring step."""

    bandwidth: float
    latency: float

    def message(self, nbytes: float) -> float:
        """Seconds of one point-to-point message."""
        return self.latency + nbytes / self.bandwidth

    def all_reduce(self, nbytes: float, ranks: int) -> float:
        """Seconds of a ring all-reduce of ``nbytes`` over ``ranks``: ``2(n-1)`` steps moving
        ``2(n-1)/n`` of the buffer through each device."""
        if ranks <= 1:
            return 0.0
        return 2 * (ranks - 1) * (self.latency + nbytes / ranks / self.bandwidth)

    def all_gather(self, nbytes: float, ranks: int) -> float:
        """Seconds of a ring all-gather (or reduce-scatter) whose whole buffer is ``nbytes``:
        ``n-1`` steps moving ``(n-1)/n`` of it."""
        if ranks <= 1:
            return 0.0
        return (ranks - 1) * (self.latency + nbytes / ranks / self.bandwidth)

    def all_to_all(self, nbytes: float, ranks: int) -> float:
        """Seconds of an all-to-all of each rank's ``nbytes``: it keeps ``1/n`` and sends
        every other rank its share, ``n-1`` exchanges moving ``(n-1)/n`` of the buffer."""
        if ranks <= 1:
            return 0.0
        return (ranks - 1) * (self.latency + nbytes / ranks / self.bandwidth)


def group_link(hardware: Hardware, span: int) -> Link:
    """The link a group uses whose members lie within ``span`` consecutive ranks: NVLink
    when that fits a node, InfiniBand otherwise (a ring is as slow as its slowest hop)."""
    if span <= hardware.gpus_per_node:
        return Link(hardware.intra_node_bandwidth, hardware.intra_node_latency)
    return Link(hardware.inter_node_bandwidth, hardware.inter_node_latency)


def members_per_node(hardware: Hardware, ranks: int, span: int) -> int:
    """Members of a group of ``ranks`` spread evenly over ``span`` consecutive ranks that
    share a node."""
    return min(ranks, max(1, ranks * hardware.gpus_per_node // span))


def all_to_all_seconds(hardware: Hardware, nbytes: float, ranks: int, span: int) -> float:
    """Seconds of an all-to-all of each rank's ``nbytes`` over ``ranks`` members spread
    evenly over ``span`` consecutive ranks. Within a node, :meth:`Link.all_to_all` over
    NVLink; across nodes, every rank exchanges with its node's members over NVLink and with
    the others over InfiniBand at once, so the slower of the two: the ``n − m`` remote
    shares (``m`` members per node) over InfiniBand, against ``m − 1`` over NVLink."""
    if ranks <= 1:
        return 0.0
    if span <= hardware.gpus_per_node:
        return group_link(hardware, span).all_to_all(nbytes, ranks)
    per_node = members_per_node(hardware, ranks, span)
    share = nbytes / ranks
    remote = (ranks - per_node) * (
        hardware.inter_node_latency + share / hardware.inter_node_bandwidth
    )
    local = (per_node - 1) * (hardware.intra_node_latency + share / hardware.intra_node_bandwidth)
    return max(remote, local)
