"""Bucketed gradient sync: buckets launched during the last backward give exactly the sums
of one allreduce at SYNC, in the same order on every replica (two gloo processes)."""

import pytest
import torch
import torch.distributed as dist

from chimera.collectives import Choices
from chimera.runtime.sync import GradSync, ReplicaGrads
from chimera.runtime.transport import TorchDist
from limits import limit
from ranks import run_ranks


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(6))).double()


def _grads(rank: int, bucket_bytes: int, group) -> tuple[torch.Tensor, int]:
    model = _model()
    grads = ReplicaGrads(model)
    sync = GradSync({(0, 0): grads}, {0: group}, rank, timeout_s=limit(60),
                    choices=Choices(bucket_bytes, True), transport=TorchDist())
    for micro in range(3):  # accumulate two micro-batches, reduce in the third
        x = torch.full((4, 16), float(rank + micro + 1), dtype=torch.float64)
        if micro == 2:
            sync.arm(0, 0)
        model(x).pow(2).sum().backward()
    early = len(sync.inflight)  # launched by the hooks, before SYNC
    sync.start(0, 0)
    sync.wait_all()
    return grads.flat.clone(), early


def _worker(rank: int, world: int) -> dict:
    group = dist.new_group([0, 1])
    whole, none_early = _grads(rank, 0, group)
    bucketed, early = _grads(rank, 16 * 17 * 8, group)  # one layer (weight + bias) per bucket
    return {"equal": torch.equal(whole, bucketed), "none_early": none_early,
            "early": early, "buckets": len(ReplicaGrads(_model()).buckets(16 * 17 * 8))}


@pytest.mark.slow
def test_buckets_reduce_during_backward_and_match_one_allreduce():
    got = run_ranks(_worker, 2, processes=True)[0]
    assert got["equal"]
    assert got["none_early"] == 0
    assert got["buckets"] == 6 and got["early"] == 6


def test_buckets_cover_the_buffer_from_its_end():
    grads = ReplicaGrads(_model())
    buckets = grads.buckets(16 * 17 * 8 * 2)
    assert [(lo, hi) for lo, hi, _ in buckets] == [(1088, 1632), (544, 1088), (0, 544)]
    assert sum(len(m) for _, _, m in buckets) == 12
