"""Spawned workers end cleanly beside a CPU hog: every teardown goes through one helper
(barrier, destroy, os._exit), so gloo never aborts at exit (issue 13, case 6)."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import chimera.api as chimera

from chimera.runtime import workers

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
        codes = []
        for _ in range(ROUNDS):
            with workers.hosted_store(2) as store:
                codes.append(workers.run(_busy_worker, (2, store), 2, grace=5.0))
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
    with workers.hosted_store(2) as store:
        codes = workers.run(_fails_on_rank_1, (2, store), 2, grace=1.0)
    assert codes[1] == 3 and codes[0] != 0
    assert workers.cause(codes) == 1  # rank 0 failed after it, on its barrier



def _killed_on_rank_1(rank, world):
    if rank == 1:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)  # no Python error: only the exit code says it
    dist.recv(torch.zeros(1), src=1)  # the victim: fails when rank 1 is gone


def test_spawn_names_a_signalled_rank_as_the_root_cause():
    with pytest.raises(chimera.SpawnError) as info:
        chimera.spawn(_killed_on_rank_1, world=2)
    first = str(info.value).splitlines()[0]
    assert first.startswith("rank 1 failed (root cause): killed by SIGTERM (no Python error)"), str(info.value)
    assert [e["rank"] for e in info.value.errors] == [1, 0]
