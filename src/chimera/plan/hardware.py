"""Hardware presets (device + network) for the planner, and a profile's links on them (no torch).

A layer's time is ``flops / (peak * efficiency(tokens)) + layer_overhead`` per pass, where
``efficiency(tokens) = efficiency * tokens / (tokens + half_tokens)``: matrix products with
few rows (a small micro-batch of short sequences) reach less of the peak. ``efficiency``
and ``half_tokens`` are assumptions, not measurements: calibrate them, or give a profile.

Links are alpha-beta (``alpha`` seconds + bytes / ``beta`` bytes per second). Ranks are laid
out as ``rank = (w * D + d) * T + t``, so a pipeline of D * T <= ``devices_per_node`` devices
stays inside a node (``intra`` links); a longer one crosses nodes, and its slowest hop sets the
pace, so every hop is priced at the inter-node link. A TP group (T divides the node) is inside
a node. A stage's allreduce group (its replicas times W)
spans nodes unless all P ranks fit in one node.

The optimizer step is memory-bound: AdamW reads the weights, gradients and its state and
writes the weights and state back, ``2 (w + o) + g`` bytes per parameter (``STATE_BYTES``)
at ``OPTIMIZER_EFFICIENCY`` of the device's memory bandwidth (an assumption; a profile's
measured ``optimizer_s_per_byte`` replaces it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from chimera.errors import UserError
from chimera.plan.memory import STATE_BYTES
from chimera.sim.cost import Link
from chimera.sim.profile import Profile

PRECISIONS = ("fp32", "mixed")
OPTIMIZER_EFFICIENCY = 0.5  # of the memory bandwidth a fused AdamW step reaches (assumed)


class PlanError(UserError):
    """Bad planner input (unknown hardware, bad profile, impossible request): exit code 2."""


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # per device, in the training precision
    memory_gib: float  # per device
    precision: str  # "fp32" (4-byte activations) or "mixed" (2-byte activations, fp32 master)
    efficiency: float  # fraction of peak that large matrix products reach
    half_tokens: int  # tokens per micro-batch at which a layer reaches half of `efficiency`
    layer_overhead_s: float  # fixed cost per layer per pass (kernel launches, framework)
    p2p: Link  # between nodes
    allreduce: Link  # per ring step between nodes
    devices_per_node: int = 1
    intra_p2p: Link | None = None
    intra_allreduce: Link | None = None
    flash_attention: bool = False  # attention scores are recomputed, not stored (T x T)
    memory_reserve: float = 0.1  # fraction lost to the CUDA context and allocator slack
    source: str = ""
    memory_bandwidth: float = 0.0  # bytes/s per device (0: the optimizer step is not priced)
    optimizer_s_per_byte: float | None = None  # measured (a profile); else from the bandwidth

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise PlanError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        for name in ("peak_flops", "memory_gib", "efficiency"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise PlanError(f"hardware {name} must be a positive number, got {value!r}")

    @property
    def usable_bytes(self) -> float:
        return self.memory_gib * 2**30 * (1 - self.memory_reserve)

    def p2p_link(self, gpus: int) -> Link:
        """The link between a pipeline's stages, which spans ``gpus`` = D * T devices."""
        if self.intra_p2p and gpus <= self.devices_per_node:
            return self.intra_p2p
        return self.p2p

    def allreduce_link(self, gpus: int) -> Link:
        """The link of a collective over ``gpus`` devices (a TP group of T stays in a node)."""
        if self.intra_allreduce and gpus <= self.devices_per_node:
            return self.intra_allreduce
        return self.allreduce

    def optimizer_time(self, params: float) -> float:
        """Seconds of one optimizer step over ``params`` parameters (module docstring)."""
        w, g, o = STATE_BYTES[self.precision]
        if self.optimizer_s_per_byte is not None:  # measured per byte of fp32 parameters
            return params * 4 * self.optimizer_s_per_byte
        if self.memory_bandwidth <= 0:
            return 0.0
        return params * (2 * (w + o) + g) / (self.memory_bandwidth * OPTIMIZER_EFFICIENCY)

    def layer_time(self, flops: float, tokens: float) -> float:
        """Seconds of one pass over one layer doing ``flops`` on ``tokens`` tokens."""
        eff = self.efficiency * tokens / (tokens + self.half_tokens)
        return flops / (self.peak_flops * eff) + self.layer_overhead_s


def _link(alpha_us: float, gb_per_s: float) -> Link:
    return Link(alpha_us * 1e-6, gb_per_s * 1e9)


PRESETS: dict[str, Hardware] = {
    # Piz Daint XC50 node, the paper's machine: one Tesla P100 16 GB (PCIe form: 9.3 TFLOP/s
    # fp32, NVIDIA P100 datasheet; CSCS Piz Daint description), Cray Aries dragonfly (~10 GB/s
    # injection, ~1 us; Alverson et al., "Cray XC Series Network", 2012). The paper trains in
    # fp32 with gloo over TCP on Aries (its repository's job scripts), which reaches a fraction
    # of that: 3 GB/s p2p and 2 GB/s per ring step are our assumption, as is the efficiency.
    "p100": Hardware(
        "p100", peak_flops=9.3e12, memory_gib=16, precision="fp32", efficiency=0.6,
        half_tokens=256, layer_overhead_s=60e-6, p2p=_link(30, 3.0), allreduce=_link(50, 2.0),
        memory_bandwidth=732e9, source="Piz Daint: P100 16 GB (9.3 TFLOP/s fp32) + Aries; gloo/TCP links assumed"),
    # DGX-1V: 8 x V100 SXM2 32 GB (125 TFLOP/s fp16 tensor cores, V100 datasheet), NVLink 2
    # hybrid cube mesh (~130 GB/s NCCL bus bandwidth), 4 x EDR InfiniBand 100 Gb/s per node
    # (~6 GB/s per GPU). Mixed precision.
    "v100": Hardware(
        "v100", peak_flops=125e12, memory_gib=32, precision="mixed", efficiency=0.45,
        half_tokens=1024, layer_overhead_s=30e-6, p2p=_link(5, 6.0), allreduce=_link(5, 6.0),
        devices_per_node=8, intra_p2p=_link(3, 40.0), intra_allreduce=_link(3, 130.0),
        memory_bandwidth=900e9, source="DGX-1V: V100 SXM2 32 GB (125 TFLOP/s fp16), NVLink 2, 4x EDR IB"),
    # DGX A100: 8 x A100 SXM4 80 GB (312 TFLOP/s bf16 dense, A100 datasheet), NVLink 3 /
    # NVSwitch (600 GB/s per GPU, ~230 GB/s NCCL bus bandwidth), 8 x HDR IB 200 Gb/s (one per
    # GPU, ~24 GB/s). Mixed precision; flash attention.
    "a100": Hardware(
        "a100", peak_flops=312e12, memory_gib=80, precision="mixed", efficiency=0.5,
        half_tokens=2048, layer_overhead_s=20e-6, p2p=_link(5, 24.0), allreduce=_link(5, 24.0),
        devices_per_node=8, intra_p2p=_link(3, 200.0), intra_allreduce=_link(3, 230.0),
        flash_attention=True, memory_bandwidth=2039e9,
        source="DGX A100: A100 SXM4 80 GB (312 TFLOP/s bf16), NVLink 3, 8x HDR IB"),
    # DGX H100: 8 x H100 SXM5 80 GB (989 TFLOP/s bf16 dense, H100 datasheet), NVLink 4 /
    # NVSwitch (900 GB/s per GPU, ~360 GB/s NCCL bus bandwidth), 8 x NDR IB 400 Gb/s (~48 GB/s
    # per GPU). Mixed precision; flash attention.
    "h100": Hardware(
        "h100", peak_flops=989e12, memory_gib=80, precision="mixed", efficiency=0.45,
        half_tokens=4096, layer_overhead_s=15e-6, p2p=_link(5, 48.0), allreduce=_link(5, 48.0),
        devices_per_node=8, intra_p2p=_link(3, 300.0), intra_allreduce=_link(3, 360.0),
        flash_attention=True, memory_bandwidth=3350e9,
        source="DGX H100: H100 SXM5 80 GB (989 TFLOP/s bf16), NVLink 4, 8x NDR IB"),
    # This kind of machine: one process per core, fp32, gloo over loopback. Rough figures
    # (an AVX2 core: 16 fp32 FMA lanes x 2 x ~3 GHz ~ 100 GFLOP/s peak); measure with a
    # profile (``--profile``) for anything that matters.
    "cpu": Hardware(
        "cpu", peak_flops=1e11, memory_gib=4, precision="fp32", efficiency=0.3, half_tokens=64,
        layer_overhead_s=100e-6, p2p=_link(50, 2.0), allreduce=_link(100, 1.0),
        devices_per_node=64, intra_p2p=_link(50, 2.0), intra_allreduce=_link(100, 1.0),
        memory_reserve=0.0, memory_bandwidth=10e9, source="one CPU core per rank, gloo on loopback (rough; use --profile)"),
}
ALIASES = {"p100+aries": "p100", "piz-daint": "p100", "daint": "p100", "v100+ib": "v100",
           "a100+ib": "a100", "h100+ib": "h100", "h100+nvlink": "h100"}


def get_hardware(name: str) -> Hardware:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise PlanError(f"unknown hardware {name!r}; known: {', '.join(PRESETS)} "
                        f"(aliases: {', '.join(ALIASES)})")
    return PRESETS[key]


def with_profile(hw: Hardware, profile: Profile) -> Hardware:
    """The hardware with the profile's links (and memory and optimizer speed, if it gives
    them)."""
    memory = profile.memory_gib or hw.memory_gib
    optimizer = profile.optimizer_s_per_byte or hw.optimizer_s_per_byte
    return replace(hw, p2p=profile.p2p, allreduce=profile.allreduce, intra_p2p=None,
                   intra_allreduce=None, memory_gib=memory, optimizer_s_per_byte=optimizer,
                   source=f"{hw.source}; profile {profile.source}")
