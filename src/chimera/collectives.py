"""A stage's gradient collectives, defined once: which, how large, cut where, issued when.

Every replica of a stage sums its gradients with the stage's other replicas (Chimera's two
pipes, times W data-parallel copies). What one replica issues for that in an iteration is
decided here and read by every part that must agree on it:

- the runtime: :class:`chimera.runtime.sync.ReplicaGrads` (the flat buffer's size and its
  buckets), :class:`~chimera.runtime.sync.GradSync` (what it issues in the last backward and
  at the Launch), the ZeRO-1 shards and ``PipelineRuntime.gather_parameters`` (after the step);
- :mod:`chimera.check.issued`, the model of the runtime's calls that the rendezvous check and
  the strict one-stream replay run (a test compares it with the runtime's recorded calls);
- the simulator (:class:`chimera.sim.cost.CostModel` prices each collective by its bytes);
- the NCCL emulation (:func:`chimera.runtime.nccl_emulation.agree`: the inputs of
  :func:`choices` must be alike on every rank).

Where a replica's collectives sit in its rank's program, and so their global order across
ranks, is the communication plan's (:mod:`chimera.check.comm_plan`: its Launch, and
``CommPlan.early`` for the last backwards a replica may reduce inside); this module says what
is issued at those places. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER = "all_reduce", "reduce_scatter", "all_gather"
# when a collective is issued, relative to the replica's program
IN_BACKWARD = "in the last backward"  # by gradient hooks, bucket by bucket (CommPlan.early)
AT_LAUNCH = "at the Launch"  # the plan's Launch after the replica's SYNC
AFTER_STEP = "after the optimizer step"  # waited for before the replica's next forward

BUCKET_BYTES = 4 * 2**20  # allreduce granularity inside the last backward on the device path


@dataclass(frozen=True)
class Choices:
    """What the device path and the CPU path decide differently. ``bucket_bytes``: bucket size
    inside the last backward, where the plan allows (0: one allreduce at the Launch);
    ``reduce_scatter``: a sharded replica reduces by reduce-scatter (else by an allreduce of
    its whole buffer, whose owned slice is copied out)."""

    bucket_bytes: int
    reduce_scatter: bool


def choices(on_device: bool, device_plan: int = 0) -> Choices:
    """The device path's choices where collectives run on the device (CUDA, NCCL); the CPU
    path's elsewhere, where buckets measured no faster (benchmarks/RESULTS.md, "Making the
    runtime fast") and gloo's reduce-scatter is slower than its allreduce
    (:mod:`chimera.runtime.shard`). ``device_plan`` (``--device-plan``): 1 makes a CPU run take
    the device path's choices, so CPU tests issue exactly the collectives a GPU run issues;
    above 1 it also sets the bucket size in bytes, so a tiny test model is cut into several
    buckets. Every rank must pass the same."""
    if on_device or device_plan:
        return Choices(device_plan if device_plan > 1 else BUCKET_BYTES, True)
    return Choices(0, False)


def flat_size(numels: Sequence[int], members: int = 1) -> int:
    """Elements of a replica's flat gradient buffer: its parameters' sum, padded to a multiple
    of ``members`` (a reduce-scatter over the group needs it; 1 when unsharded), one element at
    least (a replica with nothing to train still takes part in its stage's allreduce)."""
    return max(-(-sum(numels) // members) * members, 1)


def buckets(numels: Sequence[int], element_size: int, cap_bytes: int,
            total: int | None = None) -> list[tuple[int, int, int, int]]:
    """The buckets of a flat buffer holding parameters of ``numels`` elements in order:
    ``(start, end, first, last)`` element slices of at least ``cap_bytes`` (the one nearest the
    buffer's start may be smaller) holding parameters ``first:last``, from the end of the
    buffer to its start (the order backward finishes them). ``total``: the buffer's size (its
    padding goes to the first bucket listed); none without parameters."""
    offsets, offset = [], 0
    for n in numels:
        offsets.append(offset)
        offset += n
    out, end, last, size = [], offset if total is None else total, len(numels), 0
    for i in reversed(range(len(numels))):
        size += numels[i] * element_size
        if size >= cap_bytes:
            out.append((offsets[i], end, i, last))
            end, last, size = offsets[i], i, 0
    if last > 0:
        out.append((0, end, 0, last))
    return out


@dataclass(frozen=True)
class Collective:
    """One collective of a replica over its stage's group: ``kind``, ``size`` elements (a
    reduce-scatter's input, an all-gather's output), issued ``when``."""

    kind: str
    size: int
    when: str


def replica_collectives(bucket_sizes: Sequence[int], members: int, choices: Choices, *,
                        early: bool, sharded: bool) -> tuple[Collective, ...]:
    """The collectives one replica issues in an iteration, in order.

    ``bucket_sizes``: element counts of its buckets in launch order (:func:`buckets`; () when
    it has nothing to train); ``members``: its stage group's size (1: nothing to sum, no call);
    ``early``: the plan lets this replica reduce inside its last backward
    (``CommPlan.early``); ``sharded``: the optimizer is sharded over the group (ZeRO-1).

    - sharded with something to train: a reduce-scatter of the flat buffer at the Launch (an
      allreduce whose owned slice is copied out, on the CPU path), and after the optimizer
      step an all-gather of the updated parameters; never bucketed;
    - early on the device path: one allreduce per bucket inside the last backward (none for a
      replica with nothing to train: every replica of a frozen stage alike);
    - otherwise one allreduce of the whole flat buffer (one element at least) at the Launch.
    """
    if members <= 1:
        return ()
    whole = max(sum(bucket_sizes), 1)
    if sharded and bucket_sizes:
        kind = REDUCE_SCATTER if choices.reduce_scatter else ALL_REDUCE
        return Collective(kind, whole, AT_LAUNCH), Collective(ALL_GATHER, whole, AFTER_STEP)
    if early and choices.bucket_bytes > 0 and not sharded:
        return tuple(Collective(ALL_REDUCE, n, IN_BACKWARD) for n in bucket_sizes)
    return (Collective(ALL_REDUCE, whole, AT_LAUNCH),)


def bucketed(collectives: Sequence[Collective]) -> bool:
    """Whether the replica reduces inside its last backward (gradient hooks armed)."""
    return any(c.when == IN_BACKWARD for c in collectives)
