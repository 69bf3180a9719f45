"""Spawned workers end cleanly beside a CPU hog: every teardown goes through one helper
(barrier, destroy, os._exit), so gloo never aborts at exit (issue 13, case 6)."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from chimera.runtime import workers
from chimera.train.launch import free_port

# every test spawns gloo ranks: make test-slow
pytestmark = pytest.mark.slow

ROUNDS = 4


def _busy_worker(rank, world, port):
    with workers.gloo_group(rank, world, port):
        t = torch.ones(1 << 16)
        for _ in range(20):
            dist.all_reduce(t)
        # the last op is asynchronous: teardown must wait for it, not race it
        work = dist.all_reduce(t, async_op=True)
        work.wait()


def test_teardown_beside_a_cpu_hog():
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        codes = [workers.run(_busy_worker, (2, free_port()), 2, grace=5.0) for _ in range(ROUNDS)]
    finally:
        hog.kill()
        hog.wait()
    assert codes == [[0, 0]] * ROUNDS  # an abort at exit would be -6 (SIGABRT)


def _fails_on_rank_1(rank, world, port):
    with workers.gloo_group(rank, world, port):
        if rank == 1:
            raise SystemExit(3)
        dist.barrier()  # waits for rank 1, which is gone: ended after the grace period


def test_a_failed_rank_ends_its_peers_after_the_grace():
    codes = workers.run(_fails_on_rank_1, (2, free_port()), 2, grace=1.0)
    assert codes[1] == 3 and codes[0] != 0
    assert workers.first_failure(codes) in (0, 1)
