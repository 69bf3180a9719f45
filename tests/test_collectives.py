"""chimera.collectives: what one replica of a stage issues, defined once (no torch here; the
runtime's recorded calls are compared with the model built from it in test_rendezvous)."""

import pytest

from chimera.collectives import (AFTER_STEP, ALL_GATHER, ALL_REDUCE, AT_LAUNCH, BUCKET_BYTES,
                                 IN_BACKWARD, REDUCE_SCATTER, Choices, Collective, buckets,
                                 choices, flat_size, replica_collectives)

DEVICE, CPU = Choices(BUCKET_BYTES, True), Choices(0, False)


def test_choices_of_the_two_paths():
    assert choices(False) == CPU
    assert choices(True) == DEVICE
    assert choices(False, device_plan=1) == DEVICE  # the device plan forced on CPU
    assert choices(False, device_plan=4096) == Choices(4096, True)


def test_the_flat_buffer_is_padded_for_a_reduce_scatter_and_never_empty():
    assert flat_size([3, 4]) == 7
    assert flat_size([3, 4], members=4) == 8
    assert flat_size([], members=4) == 1  # a frozen replica still joins its stage's allreduce


def test_buckets_cut_from_the_end_at_the_cap():
    # four parameters of 10, 20, 30, 40 elements of 4 bytes; a cap of 160 bytes (40 elements)
    got = buckets([10, 20, 30, 40], 4, 160)
    assert got == [(60, 100, 3, 4), (10, 60, 1, 3), (0, 10, 0, 1)]
    assert buckets([10, 20, 30, 40], 4, 200) == [(30, 100, 2, 4), (0, 30, 0, 2)]
    assert buckets([10, 20], 4, 200, total=32) == [(0, 32, 0, 2)]  # padding in the first listed
    assert buckets([], 4, 200) == []


@pytest.mark.parametrize("sizes", [(7, 5), ()])
def test_a_stage_held_once_issues_nothing(sizes):
    assert replica_collectives(sizes, 1, DEVICE, early=True, sharded=True) == ()


def test_what_a_replica_issues():
    two = (7, 5)
    assert replica_collectives(two, 2, CPU, early=True, sharded=False) == (
        Collective(ALL_REDUCE, 12, AT_LAUNCH),)  # the CPU path never buckets
    assert replica_collectives(two, 2, DEVICE, early=False, sharded=False) == (
        Collective(ALL_REDUCE, 12, AT_LAUNCH),)  # the plan does not let this replica bucket
    assert replica_collectives(two, 2, DEVICE, early=True, sharded=False) == (
        Collective(ALL_REDUCE, 7, IN_BACKWARD), Collective(ALL_REDUCE, 5, IN_BACKWARD))
    assert replica_collectives(two, 4, DEVICE, early=True, sharded=True) == (
        Collective(REDUCE_SCATTER, 12, AT_LAUNCH), Collective(ALL_GATHER, 12, AFTER_STEP))
    assert replica_collectives(two, 4, CPU, early=True, sharded=True) == (
        Collective(ALL_REDUCE, 12, AT_LAUNCH), Collective(ALL_GATHER, 12, AFTER_STEP))


def test_a_frozen_replica():
    # unsharded and bucketed: every replica of a frozen stage alike issues nothing
    assert replica_collectives((), 2, DEVICE, early=True, sharded=False) == ()
    # otherwise one allreduce of its one-element buffer, and no shard to gather
    for early, sharded in [(False, False), (True, True), (False, True)]:
        assert replica_collectives((), 2, DEVICE, early=early, sharded=sharded) == (
            Collective(ALL_REDUCE, 1, AT_LAUNCH),)
