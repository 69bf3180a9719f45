"""The rendezvous check: every runnable schedule's plan finishes under NCCL's rules, crossing
sends and opposite collective orders fail with a picture, and the calls it replays are the
calls the real runtime makes (recorded through a fake ``torch.distributed``)."""

import pytest

from chimera.check import rendezvous as rv
from chimera.check.comm_plan import CommPlan, Launch, Message, Post, plan_comm
from chimera.ir import Action, Op, ScheduleError
from chimera.passes import SYNC_MODES, lower
from chimera.schedules import build, schemes
from chimera.check.validate import ValidationError

OPTIONS = {  # options worth sweeping; every other runnable scheme runs with its defaults
    "chimera": [{"pipes": q, "strategy": st} for q in (2, 4)
                for st in ("direct", "doubling", "halving")],
    "chimera-zb": [{"pipes": 2}, {"pipes": 4}],
    "interleaved": [{"chunks": 2}, {"chunks": 3}],
}
VARIANTS = [(s.name, opts) for s in schemes(runnable=True) for opts in OPTIONS.get(s.name, [{}])]


def _plans(name, options, depths=(2, 4, 8), sync_modes=SYNC_MODES):
    """(label, plan) for every (D, N in {D, 2D, 4D}, sync) the generator accepts."""
    for d in depths:
        for n in (d, 2 * d, 4 * d):
            for sync in sync_modes:
                try:
                    s = lower(build(name, d, n, **options), sync)
                except ScheduleError:  # e.g. pipes=4 on D=2, doubling with N not a multiple of 2Q
                    continue
                yield f"{name} {options} D={d} N={n} sync={sync}", plan_comm(s)


# W only changes who is in a stage group: p2p stays inside a pipeline copy and the copies run
# in lock-step, so W=2 is W=1 with every stage group reducing (single-replica stages too) and
# W>2 is W=2 again. Both are replayed; the validator replays W=2.
def _every_plan_passes(name, options, depths):
    checked = 0
    for label, plan in _plans(name, options, depths):
        for mode in rv.MODES:
            for w in (1, 2):
                try:
                    rv.check(plan, mode, data_parallel=w, buckets=w == 2)
                except rv.RendezvousDeadlock as exc:  # pragma: no cover - the failure's picture
                    pytest.fail(f"{label} mode={mode} W={w}:\n{exc}")
                checked += 1
    assert checked >= 8


@pytest.mark.parametrize("name,options", VARIANTS, ids=[f"{n}-{o}" for n, o in VARIANTS])
def test_every_runnable_plan_passes(name, options):
    _every_plan_passes(name, options, (2, 4))


@pytest.mark.slow  # D=8 (N up to 32) is four fifths of the sweep's time: make test-slow runs it
@pytest.mark.sweep
@pytest.mark.parametrize("name,options", VARIANTS, ids=[f"{n}-{o}" for n, o in VARIANTS])
def test_every_runnable_plan_passes_at_d8(name, options):
    _every_plan_passes(name, options, (8,))


FEW = [(name, opts, d, n) for name, opts in [(s.name, {}) for s in schemes(runnable=True)]
       + [("chimera-zb", {"pipes": 4})] for d in (2, 4) for n in (1, 2, 3)]


@pytest.mark.parametrize("name,options,d,n", FEW, ids=[f"{a}-{o}-D{d}-N{n}" for a, o, d, n in FEW])
def test_few_micro_batches(name, options, d, n):
    """Found by this check: a pipe with no micro-batch (N=1 on two pipes) had no SYNC, so its
    replicas never joined their stage's allreduce and the other replicas' allreduce hung (the
    runtime timed out too). add_sync now gives every held replica a SYNC."""
    try:
        s = lower(build(name, d, n, **options))
    except ScheduleError:
        pytest.skip("the generator refuses this shape")
    plan = plan_comm(s)
    for mode in rv.MODES:
        rv.check(plan, mode, data_parallel=2)


def _posts_before_recv(plan: CommPlan) -> CommPlan:
    """The old order: each receive posted right before the RECV that waits for it."""
    steps = []
    for prog in plan.schedule.programs:
        out = []
        for a in prog:
            if a.op in (Op.RECV_F, Op.RECV_B):
                out.append(Post(Message.of(a, plan.schedule.stages)))
            out.append(a)
        steps.append(tuple(out))
    return CommPlan(plan.schedule, tuple(steps), plan.early, plan.order, plan.collective_order)


def _deadlock(plan, mode="pair", **kw) -> rv.RendezvousDeadlock:
    with pytest.raises(rv.RendezvousDeadlock) as info:
        rv.check(plan, mode, **kw)
    return info.value


@pytest.mark.parametrize("mode", rv.MODES)
def test_crossing_sends_deadlock_1f1b(mode):
    plan = _posts_before_recv(plan_comm(lower(build("1f1b", 4, 8))))
    exc = _deadlock(plan, mode)
    text = str(exc)
    assert isinstance(exc, ValidationError) and set(exc.stuck) == {0, 1, 2, 3}
    # the last pair crosses: rank 3 sends the first gradient, rank 2 the next activation
    assert "rank 3 blocks at p0s3RECV_F1: wait for irecv p0s3F1 from rank 2" in exc.stuck[3]
    assert any("isend p0s2B0 to rank 2 (p0s3SEND_B0)" in h for h in exc.heads)
    assert any("isend p0s3F1 to rank 3 (p0s2SEND_F1)" in h for h in exc.heads)
    assert "rendezvous deadlock" in text.splitlines()[0]
    assert "P0 |" in text and "marked: p0s0RECV_B0 on P0" in text  # the grid, one wait marked


@pytest.mark.parametrize("mode", rv.MODES)
def test_crossing_sends_deadlock_chimera(mode):
    exc = _deadlock(_posts_before_recv(plan_comm(lower(build("chimera", 4, 8)))), mode)
    assert exc.stuck and all("RECV" in t or "STEP" in t for t in exc.stuck.values())
    assert any("isend" in h for h in exc.heads) and "marked:" in str(exc)


def test_crossing_sends_deadlock_chimera_d2_as_in_the_issue():
    exc = _deadlock(_posts_before_recv(plan_comm(lower(build("chimera", 2, 4)))))
    assert "rank 0 blocks at p1s1RECV_F1" in exc.stuck[0]
    assert "rank 1 blocks at p0s1RECV_F0" in exc.stuck[1]
    assert "stream 0<->1 on rank 0: isend p0s1F0 to rank 1 (p0s0SEND_F0)" in exc.heads
    assert "stream 1<->0 on rank 1: isend p1s1F1 to rank 0 (p1s0SEND_F1)" in exc.heads


def _launch_at_each_sync(plan: CommPlan) -> CommPlan:
    """chimera-zb's old collective order: each replica's allreduce at its SYNC, in program
    order, so ranks issue the stage allreduces in opposite orders."""
    steps = []
    for prog in plan.steps:
        out = []
        for x in prog:
            if not isinstance(x, Launch):
                out.append(x)
            if isinstance(x, Action) and x.op is Op.SYNC:
                out.append(Launch(x.pipe, x.stage))
        steps.append(tuple(out))
    early = tuple(frozenset() for _ in steps)
    return CommPlan(plan.schedule, tuple(steps), early, plan.order, plan.collective_order)


@pytest.mark.parametrize("d", [2, 4])
def test_opposite_collective_order_deadlocks_with_lazy_communicators(d):
    plan = plan_comm(lower(build("chimera-zb", d, 2 * d)))
    old = _launch_at_each_sync(plan)
    exc = _deadlock(old, "pair", lazy_communicators=True)
    assert all("creating the communicator of stage" in t for t in exc.stuck.values())
    if d == 2:
        assert "rank 0 blocks at launch(p0s0): creating the communicator of stage 0" in exc.stuck[0]
        assert "rank 1 blocks at launch(p0s1): creating the communicator of stage 1" in exc.stuck[1]
    # eager communicators do not save it: each rank's collectives run in one FIFO
    eager = _deadlock(old, "rank")
    assert any(h.startswith("collectives of rank") for h in eager.heads)
    for mode in rv.MODES:  # the plan's order passes, lazily created communicators and all
        for w in (1, 2):
            rv.check(plan, mode, data_parallel=w, lazy_communicators=True)


def test_cli_reports_a_deadlock_with_the_grid(monkeypatch, capsys):
    import chimera.check.comm_plan
    from chimera.cli import main

    real = chimera.check.comm_plan.plan_comm
    monkeypatch.setattr(chimera.check.comm_plan, "plan_comm", lambda s: _posts_before_recv(real(s)))
    with pytest.raises(SystemExit) as info:
        main(["simulate", "-s", "1f1b", "-D", "4", "-N", "8"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("chimera simulate: rendezvous deadlock under NCCL semantics")
    assert "blocks at p0s3RECV_F1" in err and "marked:" in err and "Traceback" not in err


def test_unknown_mode_and_unposted_receive_are_refused():
    plan = plan_comm(lower(build("1f1b", 2, 2)))
    with pytest.raises(ValueError, match="stream mode"):
        rv.check(plan, "device")
    steps = tuple(tuple(x for x in prog if not isinstance(x, Post)) for prog in plan.steps)
    bare = CommPlan(plan.schedule, steps, plan.early, plan.order, plan.collective_order)
    with pytest.raises(ValidationError, match="never posted"):
        rv.check(bare)


# -- the check stays honest: the real runtime's calls are the ones replayed ----------------
ROWS, WIDTH = 2, 3


class _Work:
    def __init__(self, log: list, index: int):
        self.log, self.index = log, index

    def wait(self, timeout=None) -> bool:
        self.log.append(("wait", self.index))
        return True

    def is_completed(self) -> bool:
        return False  # every send is then waited for at STEP, as the replay assumes


class _Group:
    def __init__(self, ranks):
        self.ranks = list(ranks)


class _RecordingDist:
    """Stands in for ``torch.distributed``: logs each call in order, returns a done work."""

    def __init__(self):
        self.log: list[tuple] = []

    def _call(self, *entry) -> _Work:
        self.log.append(entry)
        return _Work(self.log, len(self.log) - 1)

    matches_by_tag, device_collectives, timed_waits = False, True, False  # as NCCL

    def isend(self, tensor, dst, tag=0, group=None):
        return self._call("isend", dst, tag)

    def irecv(self, tensor, src, tag=0, group=None):
        return self._call("irecv", src, tag)

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        return self._call("all_reduce", group, tensor.numel())

    def reduce_scatter_single(self, output, input, group=None, async_op=False):
        return self._call("reduce_scatter", group, input.numel())

    def all_gather_single(self, output, input, group=None, async_op=False):
        return self._call("all_gather", group, output.numel())

    def new_group(self, ranks):
        return _Group(ranks)

    def get_process_group_ranks(self, group):
        return group.ranks

    def get_backend(self, group=None):
        return "nccl"  # the calls NCCL gets (off NCCL a sharded replica reduces by allreduce)


def _record(plan: CommPlan, rank: int, w: int, bucket_bytes: int,
            sharded: bool = False) -> list[tuple]:
    """The dist calls rank ``rank`` makes running one iteration of ``plan`` (tiny model);
    ``sharded``: two iterations with the optimizer sharded, each followed by the runtime's
    own ``PipelineRuntime.gather_parameters`` (on a runtime assembled from its parts)."""
    import torch

    from chimera.runtime.boundary import BoundarySpec
    from chimera.runtime.context import ExecOptions
    from chimera.runtime.executor import Executor, MicroData
    from chimera.runtime.grid import ProcessGrid
    from chimera.runtime.p2p import Mailbox
    from chimera.runtime.pipeline import PipelineRuntime
    from chimera.collectives import Choices
    from chimera.runtime.sync import GradSync, ReplicaGrads, plan_collectives

    fake = _RecordingDist()  # the transport every part is given
    s = plan.schedule
    grid = ProcessGrid(s.placement, w, rank)
    grid.build_groups(fake)
    modules = {key: torch.nn.Linear(WIDTH, WIDTH) for key in grid.held()}
    runtime = PipelineRuntime.__new__(PipelineRuntime)  # the parts gather_parameters reads
    runtime.grid, runtime.gathering, runtime.transport = grid, {}, fake
    runtime.choices = Choices(bucket_bytes, True)  # the device plan (the fake is NCCL)
    runtime.grads = {key: ReplicaGrads(m, None, len(grid.stage_ranks[key[1]]) if sharded else 1)
                     for key, m in modules.items()}
    runtime.collectives = plan_collectives(
        runtime.grads, {s: len(r) for s, r in grid.stage_ranks.items()}, runtime.choices,
        {(a.pipe, a.stage) for a in plan.early[grid.d]}, sharded)
    runtime.shards = runtime._shards()
    sync = runtime.sync = GradSync(runtime.grads, grid.stage_groups, rank, None, runtime.choices,
                                   fake, runtime.shards, runtime.collectives)
    spec = BoundarySpec.of(torch.nn.Linear(WIDTH, WIDTH)(torch.zeros(ROWS, WIDTH)))
    mailbox = Mailbox(plan, grid, lambda m: (spec.nbytes(backward=m.kind is Op.RECV_B),),
                      torch.uint8, torch.device("cpu"), None, fake)
    loss = lambda y, t: ((y - t) ** 2).mean()  # noqa: E731
    executor = Executor(s, modules, loss, sync, ExecOptions(), torch.device("cpu"),
                        early=plan.early[grid.d])
    executor.mailbox = mailbox
    executor.boundaries = [spec] * s.stages
    if sharded:
        executor.before_forward = runtime._gathered
    zeros = {m: torch.zeros(ROWS, WIDTH) for m in range(s.micro_batches)}
    for _ in range(2 if sharded else 1):
        executor.run(plan.steps[grid.d], MicroData(zeros, dict(zeros), dict.fromkeys(zeros, 1.0)))
        if sharded:
            runtime.gather_parameters()
    stage_of = {id(g): stage for stage, g in grid.stage_groups.items() if g is not None}
    return [(c[0], stage_of[id(c[1])], tuple(c[1].ranks), c[2]) if c[0] in rv.COLLECTIVES else c
            for c in fake.log]


def _sizes(plan: CommPlan, w: int, bucket_bytes: int, sharded: bool = False) -> dict:
    """Per stage, the element counts of the tiny model's buckets (as GradSync cuts them)."""
    import torch

    from chimera.runtime.sync import ReplicaGrads

    out = {}
    for stage in range(plan.schedule.stages):
        n = len(rv.stage_group(plan.schedule, stage, w)) if sharded else 1
        grads = ReplicaGrads(torch.nn.Linear(WIDTH, WIDTH), None, n)
        out[stage] = tuple(end - start for start, end, _ in grads.buckets(bucket_bytes or 1))
    return out


def _replayed(plan: CommPlan, rank: int, w: int, buckets: bool, sharded: bool = False,
              sizes: dict | None = None) -> list[tuple]:
    out = []
    for c in rv.issued_ops(plan, rank, w, buckets, sharded, sizes):
        if c.kind in (rv.ISEND, rv.IRECV):
            out.append((c.kind, c.peer, c.message.tag(plan.schedule)))
        elif c.kind in rv.COLLECTIVES:
            out.append((c.kind, c.stage, c.group, c.size))
        else:
            out.append(("wait", c.target))
    return out


HONEST = [(name, opts, d) for name, opts in
          [(s.name, {}) for s in schemes(runnable=True)] + [("chimera", {"strategy": "halving"}),
                                                            ("chimera", {"pipes": 4})]
          for d in (2, 4) if not (opts.get("pipes") == 4 and d == 2)]


@pytest.mark.parametrize("name,options,d", HONEST, ids=[f"{n}-{o}-D{d}" for n, o, d in HONEST])
def test_runtime_calls_equal_the_replayed_calls(name, options, d):
    from chimera.collectives import BUCKET_BYTES

    # bucket_bytes 0: one allreduce per replica at its Launch (the CPU plan); otherwise
    # buckets inside the last backward where the plan allows (the device plan; at 8 bytes the
    # tiny model's stage is two buckets, at BUCKET_BYTES one)
    for sync in SYNC_MODES:
        plan = plan_comm(lower(build(name, d, 2 * d, **options), sync))
        for w in (1, 2):
            for bucket_bytes in (0, 8, BUCKET_BYTES):
                for rank in range(w * d):
                    got = _record(plan, rank, w, bucket_bytes)
                    want = _replayed(plan, rank, w, bucket_bytes > 0, False,
                                     _sizes(plan, w, bucket_bytes))
                    assert got == want, f"{name} {options} D={d} sync={sync} W={w} rank {rank}"
                    assert any(c[0] == "isend" for c in got)


@pytest.mark.slow
def test_plan_and_check_import_no_torch(cli_env):
    import subprocess
    import sys

    code = ("import sys, chimera.check.comm_plan, chimera.check.rendezvous, chimera.check.validate, chimera.passes; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env=cli_env)


SHARDED = [("chimera", {}, 2), ("chimera", {"strategy": "doubling"}, 4), ("chimera", {"pipes": 4}, 4),
           ("1f1b", {}, 2), ("chimera-zb", {}, 4)]


@pytest.mark.parametrize("name,options,d", SHARDED, ids=[f"{n}-{o}-D{d}" for n, o, d in SHARDED])
def test_sharded_runtime_calls_equal_the_replayed_calls(name, options, d):
    """With the optimizer sharded the replay's two iterations are the runtime's: reduce-scatters
    at the Launches (never bucketed), all-gathers after the step, each waited for at its
    replica's first forward of the next iteration."""
    from chimera.collectives import BUCKET_BYTES

    plan = plan_comm(lower(build(name, d, 2 * d, **options)))
    for w in (1, 2):
        for rank in range(w * d):
            got = _record(plan, rank, w, BUCKET_BYTES, sharded=True)
            want = _replayed(plan, rank, w, True, True, _sizes(plan, w, BUCKET_BYTES, True))
            assert got == want, f"{name} {options} D={d} W={w} rank {rank}"
            if w == 1 and name == "1f1b":
                assert not {c[0] for c in got} & set(rv.COLLECTIVES)  # no stage has a group
                continue
            kinds = {c[0] for c in got}
            assert {"reduce_scatter", "all_gather"} <= kinds and "all_reduce" not in kinds
            gathers = [i for i, c in enumerate(got) if c[0] == "all_gather"]
            assert any(c[0] == "wait" and c[1] in gathers for c in got)  # a prefetch is waited for
        rv.check(plan, "pair", data_parallel=w, sharded=True)


def test_collectives_of_different_kinds_never_match():
    """A member whose k-th collective on a group is an all-gather while another's is a
    reduce-scatter hangs (NCCL would mismatch the buffers); the replay reports it."""
    plan = plan_comm(lower(build("chimera", 2, 2)))
    calls = [rv.issued_ops(plan, r, 1, False, sharded=True) for r in range(2)]
    first = next(i for i, c in enumerate(calls[1]) if c.kind == rv.REDUCE_SCATTER)
    c = calls[1][first]
    calls[1][first] = rv.Issued(rv.ALL_GATHER, c.step, group=c.group, stage=c.stage)
    with pytest.raises(rv.RendezvousDeadlock, match="parameter all-gather of stage"):
        rv._Replay(plan, calls, "pair", False).run()
