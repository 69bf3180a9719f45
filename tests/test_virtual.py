"""Virtual ranks (every rank a thread, p2p as copies) run the real runtime: every runnable
schedule's gradients equal single-process training; the one-GPU check runs on the CPU."""

import os
import subprocess
import sys

import pytest

from chimera.schedules import schemes
from chimera.train.config import TrainConfig
from chimera.train.equivalence import check_virtual

ROOT = os.path.join(os.path.dirname(__file__), "..")
VARIANTS = {"chimera": [{}, {"strategy": "doubling"}, {"strategy": "halving"}, {"pipes": 4}],
            "interleaved": [{"chunks": 2}]}
CASES = [(s.name, kw) for s in schemes(runnable=True) for kw in VARIANTS.get(s.name, [{}])]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,options", CASES, ids=[f"{s}-{o}" for s, o in CASES])
@pytest.mark.parametrize("stages,data_parallel", [(2, 1), (4, 1), (2, 2)])
def test_every_schedule_on_virtual_ranks_equals_one_process(schedule, options, stages, data_parallel):
    if options.get("pipes") == 4 and stages < 4:
        pytest.skip("four pipes need D >= 4")
    cfg = TrainConfig(schedule=schedule, stages=stages, data_parallel=data_parallel,
                      micro_batches=2 * stages, micro_batch_size=2, dtype="float64", steps=2,
                      **options)
    r = check_virtual(cfg)
    assert not r["missing"] and r["replicas_identical"], r
    assert r["max_grad_rel_err"] < 1e-10 and r["max_loss_rel_err"] < 1e-12, r


def test_a_failing_virtual_rank_fails_the_run_instead_of_hanging():
    from chimera.runtime.virtual import run_virtual

    def body(rank):
        import chimera.runtime.p2p as p2p
        import torch
        if rank == 1:
            raise ValueError("rank 1 broke")
        p2p.dist.recv(torch.zeros(1), src=1)  # would wait forever for rank 1

    with pytest.raises(ValueError, match="rank 1 broke"):
        run_virtual(2, body)


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"),
                        "--device", "cpu", "--out", str(tmp_path), "--profile-model", "gpt2-tiny"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    table = (tmp_path / "gpu_check.md").read_text()
    for row in ("train float32", "train bf16", "checkpoint resume", "virtual chimera D=4",
                "api.Pipeline", "profile", "host syncs"):
        assert row in table
    assert (tmp_path / "gpu_profile.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["dualpipe", "gems", "chimera-zb"])
def test_a_pipe_without_micro_batches_still_syncs(schedule):
    """N=1 on two pipes: the idle pipe's replicas join the allreduce (they hung before) and
    get the other replica's gradient."""
    cfg = TrainConfig(schedule=schedule, stages=2, micro_batches=1, micro_batch_size=2,
                      dtype="float64", steps=2)
    r = check_virtual(cfg)
    assert r["replicas_identical"] and r["max_grad_rel_err"] < 1e-10, r
