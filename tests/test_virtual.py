"""Virtual ranks (every rank a thread, p2p as copies) run the real runtime: every runnable
schedule's gradients equal single-process training; the one-GPU check runs on the CPU."""

import os
import subprocess
import sys

import pytest

from chimera.schedules import schemes
from chimera.train.config import TrainConfig
from chimera.train.equivalence import check_virtual
from limits import limit

ROOT = os.path.join(os.path.dirname(__file__), "..")
VARIANTS = {"chimera": [{}, {"strategy": "doubling"}, {"strategy": "halving"}, {"pipes": 4}],
            "interleaved": [{"chunks": 2}]}
SWEEP = [pytest.mark.slow, pytest.mark.sweep]  # in this process: make test-slow runs them on two workers
CASES = [(s.name, kw) for s in schemes(runnable=True) for kw in VARIANTS.get(s.name, [{}])]


@pytest.mark.parametrize("schedule,options", CASES, ids=[f"{s}-{o}" for s, o in CASES])
@pytest.mark.parametrize("stages,data_parallel", [  # every schedule at D=2 in the default run
    (2, 1), pytest.param(4, 1, marks=SWEEP), pytest.param(2, 2, marks=SWEEP)])
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
        import torch

        from chimera.runtime.transport import current
        if rank == 1:
            raise ValueError("rank 1 broke")
        current().recv(torch.zeros(1), src=1)  # would wait forever for rank 1

    with pytest.raises(ValueError, match="rank 1 broke"):
        run_virtual(2, body)


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"),
                        "--device", "cpu", "--out", str(tmp_path), "--profile-model", "gpt2-tiny"], capture_output=True,
                       text=True, timeout=limit(600))
    assert r.returncode == 0, r.stdout + r.stderr
    table = (tmp_path / "gpu_check.md").read_text()
    for row in ("train float32", "train bf16", "checkpoint resume", "virtual chimera D=4", "virtual chimera D=2 T=2",
                "api.Pipeline", "profile", "host syncs", "device plan: gems D=2 N=3",
                "device plan: gems D=4 N=5", "device plan: chimera D=4 sharded optimizer",
                "device plan: api.Pipeline frozen stage"):
        assert row in table
    assert "| NO |" not in table and "calls replayed with one stream per rank" in table
    assert (tmp_path / "gpu_profile.json").exists()


@pytest.mark.parametrize("schedule", ["dualpipe", "gems", "chimera-zb"])
def test_a_pipe_without_micro_batches_still_syncs(schedule):
    """N=1 on two pipes: the idle pipe's replicas join the allreduce (they hung before) and
    get the other replica's gradient."""
    cfg = TrainConfig(schedule=schedule, stages=2, micro_batches=1, micro_batch_size=2,
                      dtype="float64", steps=2)
    r = check_virtual(cfg)
    assert r["replicas_identical"] and r["max_grad_rel_err"] < 1e-10, r


def test_a_gradient_hook_on_another_thread_runs_as_its_rank():
    """CUDA's autograd runs a backward on its device thread, not the rank's: GradSync's
    bucket allreduces (gradient hooks) must still be issued as the rank that built it."""
    import threading

    import torch

    from chimera.collectives import Choices
    from chimera.runtime.sync import GradSync, ReplicaGrads
    from chimera.runtime.transport import current
    from chimera.runtime.virtual import VirtualWorld, run_virtual

    def body(rank):
        layer = torch.nn.Linear(2, 2, dtype=torch.float64)
        group = current().new_group([0, 1])
        sync = GradSync({(0, 0): ReplicaGrads(layer)}, {0: group}, rank, None, Choices(8, True),
                        transport=current())
        sync.arm(0, 0)  # a bucket per parameter, launched by its gradient hook
        x = torch.full((1, 2), float(rank + 1), dtype=torch.float64)
        device_thread = threading.Thread(target=lambda: layer(x).sum().backward())
        device_thread.start()
        device_thread.join()
        sync.start(0, 0)
        sync.wait_all()
        return layer.weight.grad.clone()

    world = VirtualWorld(2, record=True)
    grads = run_virtual(2, body, world)
    assert torch.equal(grads[0], torch.full((2, 2), 3.0, dtype=torch.float64))  # 1 + 2
    assert torch.equal(grads[0], grads[1])
    for mine in world.recorded():
        assert sum(f.get("name") == "all_reduce" for _, f in mine) == 2  # bias, weight


def _sends_first(rank):
    import torch

    from chimera.runtime.transport import current
    current().isend(torch.ones(3), 1 - rank, tag=rank)  # both ranks send first: gloo buffers
    current().irecv(torch.zeros(3), 1 - rank, tag=1 - rank).wait()


def _send_then_allreduce(rank):
    import torch

    from chimera.runtime.transport import current
    d = current()
    if rank == 0:  # the shape of issue 23: rank 0 sends, then reduces; rank 1 the other way
        d.isend(torch.ones(3), 1, tag=0)
        d.all_reduce(torch.ones(2), async_op=True).wait()
    else:
        work = d.all_reduce(torch.ones(2), async_op=True)
        d.irecv(torch.zeros(3), 0, tag=0).wait()
        work.wait()


@pytest.mark.parametrize("body,modes_ok", [(_sends_first, ()), (_send_then_allreduce, ("pair", "rank"))])
def test_recorded_calls_are_replayed_under_nccl_rules(body, modes_ok):
    from chimera.check.rendezvous import MODES, RecordedError, replay_recorded
    from chimera.runtime.virtual import VirtualWorld, run_virtual

    world = VirtualWorld(2, record=True)
    run_virtual(2, body, world)  # the virtual world buffers like gloo: it completes
    for mode in MODES:
        if mode in modes_ok:
            assert replay_recorded(world.recorded(), mode) > 0
        else:
            with pytest.raises(RecordedError, match="deadlock under NCCL semantics"):
                replay_recorded(world.recorded(), mode)


@pytest.mark.parametrize("schedule,stages,n,shard", [("gems", 2, 3, False), ("gems", 4, 5, False),
                                                     ("chimera", 2, 4, True)])
def test_device_plan_on_virtual_ranks_replays_strictly(monkeypatch, schedule, stages, n, shard):
    """What gpu_check runs on the GPU: the device path's buckets (or reduce-scatters), every
    call recorded and replayed with one stream per rank, gradients of one process."""
    from chimera.runtime.nccl_emulation import DEVICE_PLAN_ENV

    monkeypatch.setenv(DEVICE_PLAN_ENV, "256")
    cfg = TrainConfig(schedule=schedule, stages=stages, micro_batches=n, micro_batch_size=2,
                      dtype="float64", steps=2, shard_optimizer=shard)
    r = check_virtual(cfg, replay=True)
    assert r["replicas_identical"] and r["max_grad_rel_err"] < 1e-10, r
    assert r["replayed_calls"] > 0


def _tied_bn_rank(rank, schedule, n, shard):
    """api.Pipeline with a tie across stages and BatchNorm buffers (their syncs) and the batch
    fingerprint, two steps: every collective of the API besides the schedule's own."""
    import torch
    from torch import nn

    import chimera.api as chimera

    def layers():
        first, last = nn.Linear(4, 4), nn.Linear(4, 4)
        if not shard:  # ties with a sharded optimizer are refused
            last.weight = first.weight
        return [m.double() for m in (first, nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 4), last)]

    pipe = chimera.Pipeline(layers, nn.functional.mse_loss, schedule=schedule, micro_batches=n,
                            micro_batch_size=2,
                            model=chimera.ModelOptions(partition=[range(0, 3), range(3, 5)]),
                            options=chimera.ExecOptions(shard_optimizer=shard))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * n, 4, generator=g, dtype=torch.float64)
    y = torch.randn(2 * n, 4, generator=g, dtype=torch.float64)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        pipe.step(x, y)
        opt.step()
    pipe.sync_parameters()


@pytest.mark.parametrize("schedule,n,shard", [("chimera", 4, False), ("1f1b", 3, False),
                                              ("gems", 3, True)])
def test_api_collectives_replay_strictly(monkeypatch, schedule, n, shard):
    """The API's own collectives (tie and buffer syncs, the batch fingerprint, the loss) and
    the schedule's, as the virtual ranks really issued them, on one stream per rank."""
    import collections

    from chimera.check.rendezvous import replay_recorded
    from chimera.runtime.nccl_emulation import DEVICE_PLAN_ENV
    from chimera.runtime.virtual import VirtualWorld, run_virtual

    monkeypatch.setenv(DEVICE_PLAN_ENV, "64")
    world = VirtualWorld(2, record=True)
    run_virtual(2, lambda rank: _tied_bn_rank(rank, schedule, n, shard), world)
    assert replay_recorded(world.recorded(), "strict") > 0
    names = collections.Counter(f.get("name") for mine in world.recorded() for _, f in mine)
    assert names["all_reduce"] >= 6  # fingerprint, buffers, (ties), loss: per step
    if shard:
        assert names["reduce_scatter"] and names["all_gather"]
