"""Tensor parallelism under NCCL's rules: the TP layers' collectives in the order proof.

- The NCCL emulation (``--emulate-nccl``, ``RuntimeOptions.emulate_nccl``) gates a pipeline's
  TP collectives on the collective stream of its stage collectives (strict: the rank's one
  stream), and a T = 2 pipeline trains under it with one process's gradients.
- A misordered plan (a stage's allreduce launched right after its SYNC, ahead of a forward
  the other replica waits for) trains at T = 1 under the emulation and at T = 2 on plain
  transports, and the emulation stops it at T = 2: the forward's TP allreduce waits behind
  the launched allreduce. The static rendezvous check, given T, finds the same deadlock,
  and passes the real plans of every runnable schedule with T = 2; a recorded step issues
  what its model says.
- The T ranks of a pipeline rank run one program: another schedule, layers that give
  another boundary, or another mini-batch on a TP peer is refused on every rank.
- Evaluation returns the whole outputs on every TP rank.

Virtual ranks (threads), float64; the slow tests also run gloo processes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import chimera.api as chimera
from chimera.byo import seeded
from chimera.check import rendezvous as rv
from chimera.check.comm_plan import CommPlan, Launch, plan_comm
from chimera.check.validate import validate
from chimera.errors import UserError
from chimera.ir import Action, Op
from chimera.passes import lower
from chimera.runtime.context import RunContext, RuntimeOptions
from chimera.runtime.p2p import CommTimeout
from chimera.runtime.virtual import run_virtual
from chimera.schedules import build, schemes

B, N = 2, 2
RUNNABLE = [s.name for s in schemes(runnable=True)]
PLAN = {"0.0": "colwise", "0.2": "rowwise", "2.0": "colwise", "2.2": "rowwise"}


def _layers():
    return [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double(), nn.Tanh(),
            nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()]


def _batch():
    g = torch.Generator().manual_seed(3)
    return (torch.randn(B * N, 4, generator=g, dtype=torch.float64),
            torch.randn(B * N, 2, generator=g, dtype=torch.float64))


def _reference() -> tuple[float, dict]:
    with seeded(0):
        ref = nn.Sequential(*_layers())
    x, y = _batch()
    loss = nn.functional.mse_loss(ref(x), y)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in ref.named_parameters()}


def late_forward_schedule():
    """Chimera, D = 2, N = 2, with rank 1's up-pipe forward moved after its down-pipe
    backward: after its SYNC of stage 1, rank 1 still owes rank 0 the activation rank 0
    needs to reach its own SYNC of stage 1 (valid; the plan launches stage 1's allreduce
    after that send)."""
    s = build("chimera", 2, N)
    p0, p1 = s.programs
    return validate(lower(dataclasses.replace(s, programs=(p0, (p1[1], p1[2], p1[0], p1[3])))))


def launched_at_sync(plan: CommPlan) -> CommPlan:
    """``plan`` with every launch right after its SYNC, ahead of what the key order puts first."""
    steps = []
    for prog in plan.steps:
        launches = {(x.pipe, x.stage): x for x in prog if isinstance(x, Launch)}
        out = []
        for x in prog:
            if isinstance(x, Launch):
                continue
            out.append(x)
            if isinstance(x, Action) and x.op is Op.SYNC and (x.pipe, x.stage) in launches:
                out.append(launches[(x.pipe, x.stage)])
        steps.append(tuple(out))
    return dataclasses.replace(plan, steps=tuple(steps))


def _train(rank: int, schedule, tp: int, mode: str, timeout: float = 60.0) -> dict:
    """One step of the layers at T = ``tp`` under emulation ``mode`` ("" none): the loss, the
    whole gradients (gathered over TP), what the emulation gated."""
    context = RunContext.here(options=RuntimeOptions(emulate_nccl=mode, comm_timeout=timeout))
    pipe = chimera.Pipeline(_layers, nn.functional.mse_loss, schedule, micro_batches=N,
                            micro_batch_size=B, tensor_parallel=tp, context=context,
                            model=chimera.ModelOptions(tp_plan=PLAN if tp > 1 else None))
    try:
        x, y = _batch()
        loss = pipe.step(x, y)
        grads = {}
        for (_, stage), module in sorted(pipe.runtime.modules.items()):
            for name, p in module.named_parameters():
                whole = chimera.full_tensor(p.grad, chimera.shard_of(p), pipe.tp) if pipe.tp else p.grad
                grads[name] = whole
        emu = pipe.runtime.emulation
        return {"loss": loss, "grads": grads, "kinds": dict(emu.kinds) if emu else {},
                "tp_on_stream": pipe.tp is not None and pipe.tp.transport is emu}
    finally:
        if pipe.runtime.emulation is not None:
            pipe.runtime.emulation.close()


def _exact(results: list[dict]) -> None:
    ref_loss, ref_grads = _reference()
    for r in results:
        assert abs(r["loss"] - ref_loss) <= 1e-12 * abs(ref_loss)
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["pair", "strict"])
def test_tp_collectives_of_a_pipeline_run_under_the_emulation(mode):
    """T = 2, D = 2 Chimera: one process's loss and gradients; the TP group talks through the
    emulation's collective stream, which gated the layers' allreduces beside the stage
    allreduces."""
    results = run_virtual(4, lambda r: _train(r, "chimera", 2, mode))
    _exact(results)
    assert all(r["tp_on_stream"] for r in results)
    # per rank: its two replicas' gradient allreduces (strict: the step's loss and batch
    # fingerprint too), and one TP allreduce per forward (the row-parallel sum) and per
    # backward (the column-parallel input gradient) of each of its N micro-batches
    stage, api, tp = 2, (2 if mode == "strict" else 0), 2 * N
    assert all(r["kinds"]["allreduce"] == stage + api + tp for r in results), results


def test_a_tp_collective_behind_a_misordered_launch_is_caught_by_the_emulation(monkeypatch):
    """The launch-at-SYNC plan: trains at T = 1 under the emulation (p2p and collectives on
    streams of their own) and at T = 2 without it (gloo's groups are independent); at T = 2
    under the emulation rank 1's forward blocks in its TP allreduce behind stage 1's
    allreduce, which waits for rank 0, which waits for that forward's activation: a
    CommTimeout naming the tensor-parallel allreduce."""
    import chimera.runtime.pipeline as pipeline

    real = pipeline.plan_comm
    monkeypatch.setattr(pipeline, "plan_comm", lambda s: launched_at_sync(real(s)))
    schedule = late_forward_schedule()
    _exact(run_virtual(2, lambda r: _train(r, schedule, 1, "pair")))
    _exact(run_virtual(4, lambda r: _train(r, schedule, 2, "")))

    def timed_out(rank):
        try:
            _train(rank, schedule, 2, "pair", timeout=2.0)
        except CommTimeout as exc:
            return str(exc)

    said = run_virtual(4, timed_out)
    assert said[:2] == [f"rank {r}: p1s1RECV_F1 with peer rank {r + 2} timed out after 2s"
                        for r in (0, 1)], said
    assert said[2:] == [f"rank {r}: tensor-parallel allreduce with peer rank {5 - r} timed out "
                        "after 2s" for r in (2, 3)], said


# -- the static check -------------------------------------------------------------------
def test_the_rendezvous_check_models_t():
    """The launch-at-SYNC plan passes the check at T = 1 with p2p and collectives apart, and
    deadlocks at T = 2 in every stream model, the TP group's blocked forward named; the real
    plan of the same schedule passes at T = 2 and 3."""
    plan = plan_comm(late_forward_schedule())
    bad = launched_at_sync(plan)
    for mode in ("pair", "rank"):
        rv.check(bad, mode, 1, buckets=False)
    for mode in rv.MODES:
        with pytest.raises(rv.RendezvousDeadlock) as info:
            rv.check(bad, mode, 1, buckets=False, tensor_parallel=2)
        text = str(info.value)
        assert "4 ranks, T=2 per pipeline rank" in text
        assert "rank 2 blocks at p1s0F1: wait for tensor-parallel collectives of stage 0's " \
               "layers over ranks 2, 3" in text, text
        for tp in (2, 3):
            rv.check(plan, mode, 2, buckets=True, tensor_parallel=tp)


def test_tp_calls_are_the_pipeline_ranks_at_each_t():
    """Rank (w*D + d)*T + t makes pipeline rank d's calls with peers and stage groups at t,
    plus one blocking TP collective on its TP group per F, B and I (W none)."""
    plan = plan_comm(lower(build("zb-v", 2, 4)))
    one = rv.issued_ops(plan, 1, 2)  # w = 0, d = 1 at T = 1
    for t in range(2):
        calls = rv.issued_ops(plan, 2 + t, 2, tensor_parallel=2)
        tp = [c for c in calls if c.kind == rv.TP]
        assert {c.group for c in tp} == {(2, 3)}
        computes = [a for a in plan.steps[1] if isinstance(a, Action) and a.op in (Op.F, Op.B, Op.I)]
        assert len(tp) == len(computes)
        rest = [c for c in calls if c.kind != rv.TP and not (c.kind == rv.WAIT and calls[c.target].kind == rv.TP)]
        assert [(c.kind, c.peer, c.group) for c in rest] == [
            (c.kind, c.peer * 2 + t if c.peer >= 0 else -1, tuple(g * 2 + t for g in c.group))
            for c in one]


def test_validate_replays_with_t(monkeypatch):
    """``validate(schedule, tensor_parallel=T)`` (what the API, ``chimera train -T`` and
    ``chimera show -T`` run): the launch-at-SYNC plan fails at T = 1 only where p2p and
    collectives share one stream, at T = 2 already with a stream per pair of ranks."""
    import chimera.check.comm_plan as comm_plan

    schedule = late_forward_schedule()
    validate(schedule, tensor_parallel=4)
    real = comm_plan.plan_comm
    monkeypatch.setattr(comm_plan, "plan_comm", lambda s: launched_at_sync(real(s)))
    with pytest.raises(rv.RendezvousDeadlock, match=r"\(4 ranks; p2p streams: one per rank, shared"):
        validate(schedule)
    with pytest.raises(rv.RendezvousDeadlock, match=r"\(8 ranks, T=2 per pipeline rank; p2p "
                                                    r"streams: one per pair of ranks"):
        validate(schedule, tensor_parallel=4)


def test_chimera_show_checks_the_order_with_t(monkeypatch, capsys):
    """``chimera show -T 2`` validates with two TP ranks per pipeline rank; issue 23's order
    (launches right after their SYNC, posts among the sends) is still refused there."""
    import chimera.check.comm_plan as comm_plan
    from chimera.cli import main
    from test_strict_order import _old_order

    assert main(["show", "-s", "chimera", "-D", "4", "-T", "2"]) == 0
    real = comm_plan.plan_comm
    monkeypatch.setattr(comm_plan, "plan_comm", lambda s: _old_order(real(s)))
    with pytest.raises(SystemExit) as info:
        main(["show", "-s", "chimera", "-D", "2", "-N", "4", "-T", "2"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("chimera show: rendezvous deadlock under NCCL semantics (8 ranks, T=2 "
                          "per pipeline rank"), err
    assert "marked:" in err and "Traceback" not in err


# -- evaluation ------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_eval_outputs_under_tp_are_the_whole_logits_on_every_rank(arch):
    """``eval_step(..., return_outputs=True)`` at D = 2 x T = 2: every rank, each TP position
    included, returns the whole logits of the mini-batch (the column-parallel head's slices
    gathered over TP, GPT-2's vocabulary of 37 padded to 38 and stripped again) and the loss,
    as the HF model gives them in one process (float64). Chimera: both pipes' last stages."""
    import copy

    import hf_models as hm
    from chimera import hf

    ref = hm.build(arch)
    base = copy.deepcopy(ref)
    inputs, labels = hm.batch(arch, 4, 8)
    with torch.no_grad():
        want = ref(**inputs).logits
    want_loss = float(hm.loss_of(arch, want, labels))

    def rank(_):
        model = hf.load(copy.deepcopy(base), dtype=torch.float64)
        pipe = model.pipeline(schedule="chimera", stages=2, tensor_parallel=2, micro_batches=4,
                              micro_batch_size=2)
        pipe.eval()
        return pipe.eval_step(inputs, labels, return_outputs=True)

    said = run_virtual(4, rank)
    for loss, logits in said:
        assert logits.shape == want.shape == (8, hm.T, hm.V)
        torch.testing.assert_close(logits, want, rtol=1e-12, atol=1e-12)
        assert abs(loss - want_loss) <= 1e-12 * abs(want_loss)


# -- the T ranks of a pipeline rank run one program (issue 35, point 5) ------------------------
class _Narrow(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def forward(self, x):
        return x[..., :self.width]


def _pipe(layers=_layers, schedule="chimera", **kw):
    return chimera.Pipeline(layers, nn.functional.mse_loss, schedule, micro_batches=N,
                            micro_batch_size=B, tensor_parallel=2, model=chimera.ModelOptions(
                                tp_plan=PLAN, partition=[range(0, 2), range(2, 3)]), **kw)


def _refusals(body) -> list[str]:
    def rank(r):
        try:
            body(r)
        except UserError as exc:  # (ProbeError is a RuntimeError: caught apart)
            return f"UserError: {exc}"
        except chimera.ProbeError as exc:
            return f"ProbeError: {exc}"
        return "ran"
    return run_virtual(4, rank)


def test_tp_peers_that_run_other_schedules_are_refused_at_start_up():
    """Same D, W and T, another lowered program on rank 1 (TP position 1 of pipeline rank 0):
    refused on every rank by the start-up agreement on the program's hash."""
    said = _refusals(lambda r: _pipe(schedule="1f1b" if r == 1 else "gpipe"))
    assert all("disagree on the layout or the schedule" in m and "rank 1: D=2 W=1 T=2" in m
               for m in said), said


def test_tp_peers_whose_layers_give_another_boundary_are_refused():
    """Rank 1 (TP position 1 of stage 0) builds a last layer that narrows the activation:
    its probe gives another boundary than position 0's, and every rank says so, naming it."""
    from chimera.runtime.transport import current

    def layers():
        out = _layers()
        out[1] = _Narrow(3 if current().get_rank() == 1 else 4)
        return out

    said = _refusals(lambda r: _pipe(layers, example_input=torch.zeros(B, 4, dtype=torch.float64)))
    assert all(m.startswith("ProbeError: the tensor-parallel ranks of a stage disagree on its "
                            "boundary: rank 1 (TP position 1): stage 0's output is (2, 3) float64, "
                            "at TP position 0 (2, 4) float64") for m in said), said


def test_the_batch_fingerprint_covers_tp_peers():
    """Rank 1 (TP position 1 of stage 0, whose embedding-like first layer reads the inputs) is
    given another mini-batch: refused on every rank, as between pipeline ranks."""
    def body(r):
        pipe = _pipe()
        x, y = _batch()
        pipe.step(x + (r == 1), y)

    said = _refusals(body)
    assert all(m.startswith("UserError: the ranks were given different mini-batches") for m in said), said


@pytest.mark.slow  # two trainer runs of 4 virtual ranks under the emulation's threads
@pytest.mark.parametrize("schedule,mode", [("chimera", "pair"), ("zb-v", "strict")])
def test_the_trainer_with_tp_under_the_emulation_equals_one_process(schedule, mode):
    """``chimera train``'s Trainer, gpt2-tiny D = 2 x T = 2 with the device plan (buckets)
    under ``--emulate-nccl``: gradients, losses and gradient norms of one process; the
    vocab-parallel loss's and the blocks' TP collectives on the emulation's stream."""
    from chimera.train.config import TrainConfig
    from chimera.train.equivalence import check_virtual

    cfg = TrainConfig(model="gpt2-tiny", schedule=schedule, stages=2, tensor_parallel=2,
                      micro_batches=4, micro_batch_size=2, dtype="float64", steps=2,
                      emulate_nccl=mode, device_plan=1)
    r = check_virtual(cfg)
    assert not r["missing"] and r["replicas_identical"], r
    assert r["max_grad_rel_err"] < 1e-12 and r["max_loss_rel_err"] < 1e-12, r
    assert r["max_norm_rel_err"] < 1e-12, r


@pytest.mark.parametrize("schedule", ["chimera", "zb-h1"])
def test_the_model_of_a_tp_rank_is_what_the_runtime_issues(schedule):
    """A recorded step at D = 2 x T = 2 against ``issued_ops(..., tensor_parallel=2)``: the
    same sends, receives and stage allreduces in the same order on every rank, and the TP
    layers' collectives only where the model puts one (inside an F, B or I; a compute whose
    layers issue none, a first stage's backward into inputs that take no gradient, is a place
    the model waits and the runtime does not)."""
    from chimera.runtime.virtual import VirtualWorld

    world = VirtualWorld(4, record=True)
    starts = [0] * 4

    def rank(r):
        pipe = _pipe(schedule=schedule, example_input=torch.zeros(B, 4, dtype=torch.float64),
                     example_target=torch.zeros(B, 2, dtype=torch.float64))
        starts[r] = len(world.log[r])
        x, y = _batch()
        pipe.step(x, y)
        return pipe.runtime.plan, pipe.grid.tp_ranks

    results = run_virtual(4, rank, world)
    recorded = world.recorded()
    for r, (plan, tp_ranks) in enumerate(results):
        got = []
        for kind, f in recorded[r][starts[r]:]:
            if kind in (rv.ISEND, rv.IRECV):
                got.append((kind, f["peer"]))
            elif kind == "collective" and tuple(f["ranks"]) == tuple(tp_ranks):
                if got[-1:] != ["tp"]:  # a compute's several collectives: one place
                    got.append("tp")
            elif kind == "collective" and len(f["ranks"]) < 4:  # a stage's (not the world's)
                got.append((f["name"], tuple(f["ranks"])))
        want = []
        for c in rv.issued_ops(plan, r, 1, buckets=False, tensor_parallel=2):
            if c.kind in (rv.ISEND, rv.IRECV):
                want.append((c.kind, c.peer))
            elif c.kind == rv.TP:
                want.append("tp")
            elif c.kind in rv.COLLECTIVES:
                want.append((c.kind, c.group))
        it = iter(want)  # got: want with some "tp" places left out, nothing else
        for call in got:
            skipped = next(w for w in it if w == call or w != "tp" and pytest.fail(
                f"rank {r}: the runtime issued {call} where the model has {w}: {got} vs {want}"))
            assert skipped == call
        assert all(w == "tp" for w in it), (r, got, want)
        forwards = sum(1 for a in plan.schedule.programs[r // 2] if a.op is Op.F)
        assert got.count("tp") >= forwards, (r, got)  # every forward sums a row-parallel output


@pytest.mark.slow  # 4 gloo processes, and one for the reference
def test_cli_tp2_under_strict_emulation_on_gloo_processes_equals_one_process(tmp_path):
    """`chimera train -T 2 --emulate-nccl strict --device-plan 1` on 4 gloo processes: the
    losses and gradient norms of the single-process run of the same mini-batches."""
    from test_tp_pipeline import _close, _train

    ref = _train(tmp_path, "ref", "--model", "hf-llama-tiny", "--schedule", "none", "--stages", "1",
                 "-B", "16", "--steps", "3")
    got = _train(tmp_path, "tp", "--model", "hf-llama-tiny", "-D", "2", "-T", "2", "-N", "4",
                 "-B", "4", "--steps", "3", "--emulate-nccl", "strict", "--device-plan", "1")
    _close(got, ref)


def test_the_probed_boundaries_pickle_with_a_sharded_head():
    """The probe broadcasts each stage's output spec between processes: the last stage's,
    whose output is a TP head's ShardedLogits (holding its group, and so the transport),
    goes as the type's name (a gloo run died in that broadcast: cannot pickle 'module')."""
    import copy
    import pickle

    import hf_models as hm
    from chimera import hf

    base = hm.build("gpt2")
    inputs, _ = hm.batch("gpt2", 4, 8)

    def rank(_):
        model = hf.load(copy.deepcopy(base), dtype=torch.float64)
        pipe = model.pipeline(schedule="1f1b", stages=2, tensor_parallel=2, micro_batches=4,
                              micro_batch_size=2, example_input={k: v[:2] for k, v in inputs.items()})
        return pickle.loads(pickle.dumps(pipe.runtime.shapes))[-1].leaves

    for leaves in run_virtual(4, rank):
        assert [leaf.const for leaf in leaves] == ["<ShardedLogits>"], leaves


def _replay_with_t2(name, depths):
    from test_strict_order import FROZEN, _plans

    checked = 0
    for label, plan in _plans(name, depths):
        for mode in rv.MODES:
            for w, sharded, sizes in ((1, False, None), (2, True, FROZEN), (2, False, FROZEN)):
                try:
                    rv.check(plan, mode, w, buckets=True, sharded=sharded, sizes=sizes,
                             tensor_parallel=2)
                except rv.RendezvousDeadlock as exc:  # pragma: no cover - its picture
                    pytest.fail(f"{label} {mode} W={w} sharded={sharded} T=2:\n{exc}")
                checked += 1
    assert checked >= 8


@pytest.mark.parametrize("name", RUNNABLE)
def test_every_plan_replays_with_t2_small_depths(name):
    """Every runnable scheme's plan at D 2 and 4, N 1..2D+1, both sync modes, with two TP
    ranks per pipeline rank, in every stream model (W 1 and 2, sharded or not, a frozen
    stage)."""
    _replay_with_t2(name, (2, 4))


@pytest.mark.slow
@pytest.mark.sweep  # starts no process: on make test-slow's two workers
@pytest.mark.parametrize("name", RUNNABLE)
def test_every_plan_replays_with_t2_every_depth(name):
    _replay_with_t2(name, range(2, 9))
