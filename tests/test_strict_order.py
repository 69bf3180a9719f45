"""One order for p2p and collectives together (issue 23), checked without and with processes.

Without processes: every runnable schedule's plan passes the strict replay (one stream per
rank for messages and collectives), buckets included and compared by kind, size and count;
a replica's buckets are decided per stage; the orders that broke it are caught. With
processes: training under the strictest NCCL emulation with the device path's plan
(``CHIMERA_DEVICE_PLAN``: buckets, reduce-scatters) gives the gradients of one process,
through the trainer (the CLI's path) and the API, sharded or not, with a frozen stage; an
emulation set on one rank only is refused at start-up. The wide grids are marked ``slow``.
"""

import functools

import pytest

from chimera.check import rendezvous as rv
from chimera.check.comm_plan import CommPlan, Launch, Message, Post, plan_comm
from chimera.ir import Action, Op, ScheduleError
from chimera.passes import SYNC_MODES, lower
from chimera.schedules import build, schemes
from ranks import run_ranks
from limits import limit

RUNNABLE = [s.name for s in schemes(runnable=True)]
FROZEN = {0: ()}  # stage 0 has nothing to train: no buckets, no shard


def _plans(name, depths):
    """(label, plan) for D in ``depths``, N from 1 to 2D+1, both sync modes (where built)."""
    for d in depths:
        for n in range(1, 2 * d + 2):
            for sync in SYNC_MODES:
                try:
                    s = lower(build(name, d, n), sync)
                except ScheduleError:
                    continue
                yield f"{name} D={d} N={n} sync={sync}", plan_comm(s)


def _replay_all(name, depths):
    checked = 0
    for label, plan in _plans(name, depths):
        assert _buckets_per_stage(plan), label
        for w in (1, 2):
            for sharded in (False, True):
                for sizes in (None, FROZEN):
                    try:
                        rv.check(plan, "strict", w, buckets=True, sharded=sharded, sizes=sizes)
                    except rv.RendezvousDeadlock as exc:  # pragma: no cover - its picture
                        pytest.fail(f"{label} W={w} sharded={sharded} sizes={sizes}:\n{exc}")
                    checked += 1
    assert checked >= 8


@pytest.mark.parametrize("name", RUNNABLE)
def test_strict_replay_small_depths(name):
    _replay_all(name, (2, 4))


@pytest.mark.slow
@pytest.mark.sweep
@pytest.mark.parametrize("name", RUNNABLE)
def test_strict_replay_every_depth(name):
    _replay_all(name, range(2, 9))


def _buckets_per_stage(plan: CommPlan) -> bool:
    """Every replica of a stage buckets, or none does."""
    s = plan.schedule
    bucketed = {a.stage for early in plan.early for a in early}
    for stage in bucketed:
        ranks = {r for r, early in enumerate(plan.early) if any(a.stage == stage for a in early)}
        if ranks != set(s.placement.replicas(stage)):
            return False
    return True


def _per_rank_buckets(plan: CommPlan) -> CommPlan:
    """The old decision: a replica buckets when, at its last backward, its launch is the
    next one of its rank, whatever the stage's other replicas do (GEMS with odd N)."""
    early = []
    for steps in plan.steps:
        launches = [x for x in steps if isinstance(x, Launch)]
        last_b = {(x.pipe, x.stage): x for x in steps if isinstance(x, Action) and x.op is Op.B}
        mine, k = set(), 0
        for x in steps:
            if isinstance(x, Launch):
                k += 1
            elif x in last_b.values() and k < len(launches) and \
                    (launches[k].pipe, launches[k].stage) == (x.pipe, x.stage):
                mine.add(x)
        early.append(frozenset(mine))
    return CommPlan(plan.schedule, plan.steps, tuple(early), plan.order, plan.collective_order)


@pytest.mark.parametrize("d,n", [(2, 1), (2, 3), (2, 5), (4, 3), (4, 5)])
def test_gems_odd_n_buckets_alike_on_every_replica(d, n):
    """Issue 23: one replica of a stage issued k bucket allreduces, the other one allreduce."""
    plan = plan_comm(lower(build("gems", d, n)))
    assert _buckets_per_stage(plan)
    for mode in rv.MODES:
        rv.check(plan, mode, 2, buckets=True)
    bad = _per_rank_buckets(plan)
    if not _buckets_per_stage(bad):
        with pytest.raises(rv.CollectiveMismatch, match=r"stage \d's group: collective #0"):
            rv.check(bad, "pair", 2, buckets=True)


def test_gems_d2_n3_per_rank_buckets_mismatch():
    bad = _per_rank_buckets(plan_comm(lower(build("gems", 2, 3))))
    assert not _buckets_per_stage(bad)
    with pytest.raises(rv.CollectiveMismatch) as info:
        rv.check(bad, "rank", 1, buckets=True, sizes={0: (5, 7), 1: (5, 7)})
    text = str(info.value)
    assert "allreduce of stage" in text and "(5 elements)" in text and "(12 elements)" in text
    assert "marked:" in text  # the grid, the offending action marked


def _old_order(plan: CommPlan) -> CommPlan:
    """The order before issue 23: posts placed among the sends only (before the first send
    later in the message order), each launch right after its SYNC."""
    s, steps = plan.schedule, []
    for prog in s.programs:
        incoming = sorted((plan.order[Message.of(a, s.stages)], Message.of(a, s.stages))
                          for a in prog if a.op in (Op.RECV_F, Op.RECV_B))
        out, k = [], 0
        for a in prog:
            limit = -1
            if a.op in (Op.SEND_F, Op.SEND_B, Op.RECV_F, Op.RECV_B):
                limit = plan.order[Message.of(a, s.stages)] + (a.op in (Op.RECV_F, Op.RECV_B))
            while k < len(incoming) and incoming[k][0] < limit:
                out.append(Post(incoming[k][1]))
                k += 1
            out.append(a)
            if a.op is Op.SYNC:
                out.append(Launch(a.pipe, a.stage))
        steps.append(tuple(out))
    early = tuple(frozenset() for _ in steps)
    return CommPlan(s, tuple(steps), early, plan.order, plan.collective_order)


def test_old_order_deadlocks_only_in_the_strict_model():
    """Issue 23: sharded Chimera, rank 0 sends then reduce-scatters, rank 1 reduce-scatters
    then posts that receive: fine with p2p and collectives apart, a hang on one stream."""
    old = _old_order(plan_comm(lower(build("chimera", 2, 4))))
    for mode in ("pair", "rank"):
        rv.check(old, mode, 1, buckets=False, sharded=True)
    with pytest.raises(rv.RendezvousDeadlock) as info:
        rv.check(old, "strict", 1, buckets=False, sharded=True)
    heads = " ".join(info.value.heads)
    assert "stream of rank 1: reduce-scatter of stage 1" in heads and "isend" in heads
    assert "shared with the collectives" in str(info.value).splitlines()[0]
    rv.check(plan_comm(lower(build("chimera", 2, 4))), "strict", 1, buckets=False, sharded=True)


def test_plan_issues_in_one_global_order():
    """Every rank's posts, sends and launches follow the global keys: messages by
    ``CommPlan.order``, a launch after every message of the rank it must follow."""
    for name in ("chimera", "gems", "dualpipe", "zb-v"):
        plan = plan_comm(lower(build(name, 4, 8)))
        s = plan.schedule
        for steps in plan.steps:
            seen = [plan.order[x.message] if isinstance(x, Post) else plan.order[Message.of(x, s.stages)]
                    for x in steps if isinstance(x, Post) or
                    (isinstance(x, Action) and x.op in (Op.SEND_F, Op.SEND_B))]
            assert seen == sorted(seen), name


# -- with processes: the strictest emulation, the device plan, one process's gradients -----
DEVICE_PLAN = "64"  # bytes: the tiny models' stages are cut into several buckets


@pytest.fixture
def strict_env(monkeypatch):
    from chimera.runtime.nccl_emulation import ENV
    from chimera.runtime.nccl_emulation import DEVICE_PLAN_ENV

    monkeypatch.setenv(ENV, "strict")
    monkeypatch.setenv(DEVICE_PLAN_ENV, DEVICE_PLAN)


def _configs(rows, stages, dp=1):
    """TrainConfigs of the rows whose generator takes (stages, n)."""
    from chimera.train import TrainConfig

    out = []
    for s, kw, n in rows:
        try:
            build(s, stages, n)
        except ScheduleError:
            continue
        out.append(TrainConfig(schedule=s, stages=stages, micro_batches=n, data_parallel=dp,
                               dtype="float64", steps=2, progress=False, **kw))
    return out


def _assert_equivalent(reports):
    for r in reports:
        c = r["config"]
        what = f"{c['schedule']} D={c['stages']} N={c['micro_batches']} W={c['data_parallel']} " \
               f"shard={c['shard_optimizer']}"
        assert not r["missing"], what
        assert r["max_grad_rel_err"] < 1e-10, what
        assert r["max_loss_rel_err"] < 1e-10, what
        assert r["replicas_identical"], what


D2 = [("gems", {}, 3), ("gems", {}, 1), ("chimera", {}, 4), ("chimera", {"shard_optimizer": True}, 4),
      ("dualpipe", {}, 4), ("1f1b", {}, 3)]


@pytest.mark.slow
def test_trainer_under_strict_emulation_with_device_plan(strict_env):
    from chimera.train.equivalence import check_equivalence

    _assert_equivalent(check_equivalence(_configs(D2, 2)))


D4 = [(name, {}, n) for name in RUNNABLE for n in (1, 5, 9)] + \
    [(name, {"shard_optimizer": True}, 4) for name in ("chimera", "gems", "dualpipe", "zb-v")]


@pytest.mark.slow
def test_trainer_under_strict_emulation_wide(strict_env):
    from chimera.train.equivalence import check_equivalence

    _assert_equivalent(check_equivalence(_configs(D4, 4)))
    _assert_equivalent(check_equivalence(_configs(
        [("chimera", {}, 3), ("gems", {}, 3), ("chimera", {"shard_optimizer": True}, 4)], 2, dp=2)))


D8 = [("chimera", {}, 8), ("chimera", {"shard_optimizer": True}, 8), ("gems", {}, 9),
      ("dualpipe", {}, 8), ("1f1b", {}, 1), ("chimera-zb", {}, 8)]
# (zb-v and dualpipev would need 16 stages: gpt2-tiny has 8 layers)


@pytest.mark.slow
def test_trainer_under_strict_emulation_depth_8(strict_env):
    from chimera.train.equivalence import check_equivalence

    _assert_equivalent(check_equivalence(_configs(D8, 8)))


def _frozen_layers():
    from torch import nn

    layers = [nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)]
    layers[0].requires_grad_(False)  # stage 0 holds only this and an activation
    return [layer.double() for layer in layers]


def _tied_layers():
    from torch import nn

    first, tied = nn.Linear(4, 4), nn.Linear(4, 4)
    tied.weight = first.weight  # one logical parameter in stages 0 and 1
    layers = [first, nn.Tanh(), nn.Linear(4, 4), tied, nn.Tanh(), nn.Linear(4, 2)]
    return [layer.double() for layer in layers]


def _api_rank(rank, world, schedule, n, shard, tied=False) -> dict:
    """The API with a frozen stage (or a tie across stages: its gradient sync) under the
    strict emulation and the device plan, against the same layers in one process
    (``Pipeline`` seeds the layers with 0)."""
    import torch
    from torch import nn

    import chimera.api as chimera
    from chimera.byo import seeded

    make = _tied_layers if tied else _frozen_layers
    pipe = chimera.Pipeline(make, nn.functional.mse_loss, schedule=schedule, micro_batches=n,
                            micro_batch_size=2,
                            model=chimera.ModelOptions(partition=[range(0, 2), range(2, 6 if tied else 5)]),
                            options=chimera.ExecOptions(shard_optimizer=shard))
    g = torch.Generator().manual_seed(5)
    x, y = (torch.randn(2 * n, 4, generator=g, dtype=torch.float64),
            torch.randn(2 * n, 2, generator=g, dtype=torch.float64))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        opt.zero_grad()
        losses.append(pipe.step(x, y))
        opt.step()
    params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    with seeded(0):
        ref = nn.Sequential(*make())
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    ref_losses = []
    for _ in range(2):
        ref_opt.zero_grad()
        loss = nn.functional.mse_loss(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(float(loss.detach()))
    ref_params = dict(ref.named_parameters(remove_duplicate=False))  # a tie under both names
    err = max(float((p - ref_params[n]).abs().max()) for n, p in params.items())
    rt = pipe.runtime
    return {"losses": losses, "ref_losses": ref_losses, "param_err": err,
            "mode": rt.emulation.mode, "kinds": dict(rt.emulation.kinds),
            "messages": sum(rt.emulation.sent.values()), "bucket_bytes": rt.choices.bucket_bytes,
            "shards": sorted(rt.shards)}


@pytest.mark.parametrize("schedule,n,shard", [("gems", 3, True), ("chimera", 4, True),
                                               ("1f1b", 3, False)])
def test_api_frozen_stage_under_strict_emulation(strict_env, schedule, n, shard):
    """Issue 23: a sharded stage with nothing to train built a reduce-scatter of 1 element in
    and 0 out; now it has no shard and keeps the allreduce its replicas issue alike. (The
    emulation over virtual ranks: its rules, not gloo's, are the subject.)"""
    for r in run_ranks(functools.partial(_api_rank, schedule=schedule, n=n, shard=shard), 2):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-12)
        assert r["param_err"] < 1e-12
        assert r["mode"] == "strict" and r["bucket_bytes"] == int(DEVICE_PLAN) and r["messages"]
        assert all(stage != 0 for _, stage in r["shards"])  # the frozen stage has no shard
        if shard:  # the device plan's reduce-scatters, through the one stream
            assert r["kinds"].get("reduce-scatter", 0) >= 2 and r["kinds"].get("all-gather")


@pytest.mark.parametrize("schedule,n", [("1f1b", 3), ("gems", 3)])
def test_api_tie_under_strict_emulation(strict_env, schedule, n):
    """A tie across ranks (1f1b: an allreduce over its holders) or on both (gems: a local
    sum), the batch fingerprint and the loss on the strict emulation's one stream."""
    for r in run_ranks(functools.partial(_api_rank, schedule=schedule, n=n, shard=False,
                                         tied=True), 2):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-12)
        assert r["param_err"] < 1e-12
        assert r["kinds"]["allreduce"] >= 4  # fingerprint and loss per step, at least


def _mixed_env_rank(rank, world) -> str:
    import os

    import torch
    import torch.distributed as dist
    from torch import nn

    from chimera.errors import UserError
    from chimera.runtime.context import RunContext
    from chimera.runtime.grid import ProcessGrid
    from chimera.runtime.nccl_emulation import ENV
    from chimera.runtime.pipeline import PipelineRuntime

    if rank == 1:
        os.environ[ENV] = "strict"  # rank 0 runs plain gloo
    schedule = lower(build("chimera", 2, 2))
    try:
        PipelineRuntime(schedule, ProcessGrid(schedule.placement, 1, dist.get_rank()),
                        lambda s: nn.Linear(2, 2), nn.functional.mse_loss, RunContext.here(),
                        example=torch.zeros(1, 2))
        message = "built"
    except UserError as exc:
        message = str(exc)
    return message


@pytest.mark.slow
def test_emulation_set_on_one_rank_is_refused(monkeypatch):
    """Processes: the environment of one rank differs from the other's."""
    from chimera.runtime.nccl_emulation import ENV

    monkeypatch.delenv(ENV, raising=False)
    for rank, message in enumerate(run_ranks(_mixed_env_rank, 2, processes=True)):
        assert message.startswith(f"rank {rank}: the NCCL emulation and device plan must be set alike")
        assert "\n" not in message and "rank 1: CHIMERA_EMULATE_NCCL='strict'" in message


def test_device_plan_switch(monkeypatch):
    import torch

    from chimera.errors import UserError
    from chimera.collectives import BUCKET_BYTES, Choices
    from chimera.runtime.sync import comm_choices

    from chimera.runtime.context import RuntimeOptions
    from chimera.runtime.nccl_emulation import DEVICE_PLAN_ENV

    cpu = torch.device("cpu")
    assert comm_choices(cpu) == Choices(0, False)  # the CPU path
    assert comm_choices(cpu, device_collectives=True) == Choices(BUCKET_BYTES, True)
    assert comm_choices(torch.device("cuda", 0)) == Choices(BUCKET_BYTES, True)
    assert comm_choices(cpu, device_plan=1) == Choices(BUCKET_BYTES, True)
    assert comm_choices(cpu, device_plan=4096) == Choices(4096, True)
    # the environment variable is one way to set the option, read where a run starts
    for text, plan in (("", 0), ("1", 1), ("4096", 4096)):
        monkeypatch.setenv(DEVICE_PLAN_ENV, text)
        assert RuntimeOptions.from_env().device_plan == plan
    monkeypatch.setenv(DEVICE_PLAN_ENV, "yes")
    with pytest.raises(UserError, match="device plan 'yes'.*CHIMERA_DEVICE_PLAN"):
        RuntimeOptions.from_env()


def test_validator_refuses_per_rank_buckets_in_one_line(monkeypatch, capsys):
    """The CLI validates before anything runs: the old per-rank bucket decision is refused
    with the mismatched members named and the grid."""
    import chimera.check.comm_plan
    from chimera.cli import main

    real = chimera.check.comm_plan.plan_comm
    monkeypatch.setattr(chimera.check.comm_plan, "plan_comm", lambda s: _per_rank_buckets(real(s)))
    with pytest.raises(SystemExit) as info:
        main(["show", "-s", "gems", "-D", "2", "-N", "3"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("chimera show: stage ") and "collective #0 differs" in err
    assert "marked:" in err and "Traceback" not in err


@pytest.mark.slow
def test_cli_sharded_under_strict_emulation(tmp_path, cli_env):
    """``chimera train --shard-optimizer`` (Chimera's reduce-scatters between messages: the
    hang of issue 23 on one stream) under the strict emulation and the device plan."""
    import json
    import subprocess
    import sys

    from chimera.runtime.nccl_emulation import ENV
    from chimera.runtime.nccl_emulation import DEVICE_PLAN_ENV

    def losses(emulate):
        env = {k: v for k, v in cli_env.items() if k not in (ENV, DEVICE_PLAN_ENV)}
        if emulate:
            env.update({ENV: "strict", DEVICE_PLAN_ENV: "4096"})
        log = tmp_path / f"log-{emulate}.jsonl"
        r = subprocess.run([sys.executable, "-m", "chimera", "train", "--steps", "2",
                            "--shard-optimizer", "--no-progress", "--log-json", str(log)],
                           capture_output=True, text=True, timeout=limit(300), env=env)
        assert r.returncode == 0, r.stderr
        return [json.loads(line)["loss"] for line in log.read_text().splitlines()]

    assert losses(True) == pytest.approx(losses(False), rel=1e-6)
