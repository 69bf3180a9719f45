"""The emulated bench with W pipeline copies (``chimera bench --emulate --data-parallel W``,
issue 36): every schedule's data-parallel gradient reduction runs, ours over our replica
groups and torch's at its REDUCE_GRAD, and every simulated column prices it as the simulator
does for that layout (no timing is asserted)."""

import dataclasses
import json

import pytest
import torch
from torch import nn

from chimera.bench import prices
from chimera.bench.emulated import our_schedule, simulated
from chimera.bench.rows import BenchConfig, Row
from chimera.bench.torch_dp import StageReduction
from chimera.bench.torch_orders import torch_order
from chimera.cli import build_parser
from chimera.cli.bench_cmd import _stem, config_from_args
from chimera.passes import lower
from chimera.runtime import workers
from chimera.schedules import build
from chimera.sim import CostModel, simulate

LAT = {"p2p_s": 0.0, "allreduce_s": 0.0}


def cfg(**kw) -> BenchConfig:
    return BenchConfig(**{"emulate": "2:2:2", "stages": 2, "micro_batches": 4,
                          "allreduce_ms": 5.0, "data_parallel": 2, **kw})


def test_bad_copies_head_params_and_sharding_are_refused_in_one_line(capsys):
    from chimera.cli import main
    from chimera.errors import UserError

    for kw in ({"data_parallel": 0}, {"head_params": 0.5}, {"embed_params": "2"},
               {"shard_optimizer": 1}):
        with pytest.raises(UserError):
            cfg(**kw)
    for kw in ({"data_parallel": 2}, {"head_params": 2.0}, {"shard_optimizer": True}):
        with pytest.raises(UserError, match="emulated stages only"):
            BenchConfig(**kw)
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--emulate", "1:1:1", "-W", "0"])
    assert exit_.value.code == 2 and "data-parallel" in capsys.readouterr().err


def test_the_cli_passes_the_copies_and_names_its_files():
    c = config_from_args(build_parser().parse_args(
        ["bench", "--emulate", "1:2:1", "-D", "4", "-W", "2", "--allreduce-ms", "3",
         "--head-params", "1.5"]))
    assert (c.data_parallel, c.world, c.global_batch, c.head_params) == (2, 8, 2 * 8 * 2, 1.5)
    assert _stem(c) == "bench-emulated-D4-N8-hp1.5-ar3ms-W2"
    assert "--data-parallel 2" in c.extra["command"] and "--head-params 1.5" in c.extra["command"]


def _by_hand(schedule, c: BenchConfig, lat: dict) -> CostModel:
    """The layout's prices written out: D=2, 2 layers per D-th, F:I:W 2:2:2 ms per D-th,
    5 ms per D-th of gradients, W copies."""
    per = c.stages / schedule.stages  # a stage's share of a D-th (a V stage: half)
    f, i, w = (2e-3 * per,) * 3
    return CostModel(f=(f,) * schedule.stages, b=(i + w,) + (i + w,) * (schedule.stages - 1),
                     i=(0.0,) + (i,) * (schedule.stages - 1),
                     w=(i + w,) + (w,) * (schedule.stages - 1),
                     p2p_time=lat["p2p_s"], allreduce_time=lat["allreduce_s"],
                     reduce=(5e-3 * per,) * schedule.stages, data_parallel=c.data_parallel)


@pytest.mark.parametrize("impl, name", [("chimera", "chimera"), ("chimera", "zb-v"),
                                        ("torch", "1f1b"), ("torch", "zbv")])
def test_the_simulated_column_prices_every_copys_reduction_as_the_simulator(impl, name):
    c, lat = cfg(), {"p2p_s": 1e-3, "allreduce_s": 0.5e-3}
    s = our_schedule(c, Row(impl, name)) if impl == "chimera" else torch_order(name, 2, 4)
    want = simulate(lower(s, "eager"), _by_hand(s, c, lat))
    assert simulated(s, c, lat)["simulated_step_s"] == pytest.approx(want.makespan, rel=1e-12)
    assert want.collectives  # W=2: every schedule reduces


def test_a_linear_schedule_pays_its_first_stages_reduction_after_its_last_backward():
    """1F1B on D=2: the first stage's last backward ends the step; with W=2 its allreduce
    (5 ms, a D-th) follows it; at W=1 a linear schedule reduces nothing."""
    one = simulated(build("1f1b", 2, 4), cfg(data_parallel=1), LAT)["simulated_step_s"]
    two = simulated(build("1f1b", 2, 4), cfg(), LAT)
    assert two["simulated_step_s"] == pytest.approx(one + 5e-3)
    assert sorted(r for r, *_ in two["timeline"].collectives) == [0, 1]


class _Stage:
    def __init__(self):
        self.submod = nn.Linear(2, 2)
        self.scaled = []

    def perform_reduce_grad(self, grad_scale_factor):
        self.scaled.append(grad_scale_factor)


class _Done:
    """A collective's work, done."""

    def wait(self, timeout=None):
        return True

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(None)
        return future


class _OtherCopy:
    """A data-parallel group of two whose other copy's gradients are all ones."""

    def __init__(self):
        self.calls = []

    def all_reduce(self, tensor, group=None, async_op=False):
        self.calls.append((tensor.numel(), group, async_op))
        tensor += 1.0
        return _Done()


def test_torchs_reduce_grad_starts_the_copies_allreduce_and_the_step_waits_for_it():
    stage, transport = _Stage(), _OtherCopy()
    reduction = StageReduction([stage], "dp", transport, copies=2)
    for p in stage.submod.parameters():
        p.grad = torch.full_like(p, 3.0)
    stage.perform_reduce_grad(4)  # what torch's schedule calls at REDUCE_GRAD
    assert stage.scaled == [4]  # torch's own (scaling by 1/N) ran first
    assert transport.calls == [(6, "dp", True)]  # one flat, asynchronous allreduce
    reduction.wait()
    assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in stage.submod.parameters())
    assert reduction.pending == []


class _Sharded:
    """A data-parallel group of two, this copy its member 1: records what is issued."""

    def __init__(self):
        self.calls = []

    def get_rank(self, group=None):
        return 1

    def reduce_scatter_single(self, output, input, group=None, async_op=False):
        self.calls.append(("reduce_scatter", output.numel(), input.numel(), async_op))
        return _Done()

    def all_gather_single(self, output, input, group=None, async_op=False):
        self.calls.append(("all_gather", output.numel(), input.numel(), async_op))
        return _Done()


def test_torchs_sharded_rows_reduce_scatter_and_gather_before_the_first_forward():
    stage, transport = _Stage(), _Sharded()
    stage.submod = nn.Linear(2, 3)  # 9 parameters: padded to 10 for two copies
    reduction = StageReduction([stage], "dp", transport, copies=2, sharded=True)
    reduction.gather()  # the step starts
    assert transport.calls == [("all_gather", 10, 5, True)]
    assert reduction.gathering
    stage.submod(torch.zeros(1, 2))  # its first forward waits for it
    assert not reduction.gathering
    for p in stage.submod.parameters():
        p.grad = torch.ones_like(p)
    stage.perform_reduce_grad(4)
    assert transport.calls[-1] == ("reduce_scatter", 5, 10, True) and stage.scaled == [4]
    reduction.wait()
    assert reduction.pending == []


def test_sharded_rows_where_a_stage_has_a_group_and_their_halves_priced():
    from chimera.bench.rows import all_rows

    one = {r.id for r in all_rows(cfg(data_parallel=1, shard_optimizer=True))}
    assert "chimera:chimera:shard=1" in one and "chimera:1f1b:shard=1" not in one  # W=1: no group
    two = {r.id for r in all_rows(cfg(shard_optimizer=True))}
    assert {"chimera:chimera:shard=1", "chimera:1f1b:shard=1", "chimera:zb-v:shard=1"} <= two
    assert {"torch:1f1b:shard=1", "torch:zbv:shard=1"} <= two  # torch's FSDP-like rows
    assert not any("shard" in r for r in one if r.startswith("torch"))  # W=1: no group
    assert not any("shard" in r for r in two if r.startswith("floor"))
    assert not any("shard" in r.id for r in all_rows(cfg()))  # only when asked
    # ZeRO-1 at W=1 on Chimera's pairs: a reduce-scatter of half the allreduce's time, and
    # the all-gather of the stage a rank runs first before the next step's first forward
    c = cfg(data_parallel=1, stages=4, micro_batches=8, allreduce_ms=10.0)
    s = build("chimera", 4, 8)
    whole, half = (simulated(s, c, LAT, sharded=k) for k in (False, True))
    assert all(e - b == pytest.approx(10e-3) for *_, b, e in whole["timeline"].collectives)
    assert all(e - b == pytest.approx(5e-3) for *_, b, e in half["timeline"].collectives)
    assert half["simulated_step_s"] == pytest.approx(simulate(
        lower(s, "eager"), prices.cost_model(c, s, 2e-3, 2e-3, 2e-3, sharded=True)).makespan)


def test_the_rows_transport_prices_a_reduce_scatter_and_an_all_gather_at_half():
    from chimera.bench.links import PricedTransport

    class Inner:
        def reduce_scatter_single(self, output, input, group=None, async_op=False):
            return _Done()

        all_gather_single = reduce_scatter_single

        def all_reduce(self, tensor, op=None, group=None, async_op=False):
            return _Done()

    t = PricedTransport(Inner(), None, seconds_per_float=1e-3)
    rs = t.reduce_scatter_single(torch.zeros(5), torch.zeros(10), group="g", async_op=True)
    ag = t.all_gather_single(torch.zeros(10), torch.zeros(5), group="g", async_op=True)
    ar = t.all_reduce(torch.zeros(10), group="g", async_op=True)
    assert all(w.wait() for w in (rs, ag, ar))  # one after another on the rank's channel
    assert ag.due - rs.due == pytest.approx(5e-3) and ar.due - ag.due == pytest.approx(10e-3)
    assert isinstance(t.all_gather_single(torch.zeros(10), torch.zeros(5), group="g"), _Done)


# -- spawned ranks -------------------------------------------------------------------------------
def _grads_worker(rank, world, port, out):
    from chimera.bench.emulated import EmulatedOurs, EmulatedTorch
    from chimera.bench.start import bench_context

    c = cfg(allreduce_ms=1.0)
    context = bench_context(60.0)
    with workers.gloo_group(rank, world, port):
        got = {}
        for row in (Row("chimera", "1f1b"), Row("torch", "1f1b"), Row("torch", "zbv"),
                    Row("torch", "dualpipev"), Row("torch", "interleaved")):
            runner = (EmulatedOurs if row.impl == "chimera" else EmulatedTorch)(c, row, context)
            loss = runner.step(0)
            grads = [p.grad.clone() for p in runner.params]
            got[row.id] = (loss, torch.cat([g.reshape(-1) for g in grads]))
        torch.save(got, f"{out}/{rank}.pt")


@pytest.mark.slow
def test_every_copy_ends_the_step_with_the_mean_gradient_ours_and_torchs(tmp_path):
    """W=2 copies of D=2: each copy trains on its half of the mini-batch, so the copies agree
    only if the reduction ran; torch's 1F1B and ours then hold the same gradients (the same
    model, data and mean loss) and report the same loss."""
    with workers.hosted_store(4) as store:
        codes = workers.run(_grads_worker, (4, store, str(tmp_path)), 4, grace=5.0)
    assert codes == [0, 0, 0, 0]
    got = [torch.load(tmp_path / f"{r}.pt") for r in range(4)]
    for d in (0, 1):
        for row in got[d]:
            assert torch.allclose(got[d][row][1], got[2 + d][row][1], atol=1e-7), (d, row)
        assert torch.allclose(got[d]["chimera:1f1b"][1], got[d]["torch:1f1b"][1], atol=1e-7)
    losses = {round(g[row][0], 6) for g in got for row in g}
    assert len(losses) == 1


@pytest.mark.slow
def test_bench_emulate_runs_ours_and_torchs_rows_on_w_copies(run_cli, tmp_path):
    rows = "chimera:chimera,chimera:1f1b,torch:1f1b,torch:zbv"
    r = run_cli("bench", "--emulate", "2:2:2", "-D", "2", "-N", "4", "-W", "2", "--steps", "1",
                "--warmup", "0", "--rows", rows, "--allreduce-ms", "5", "--shard-optimizer",
                "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "bench-emulated-D2-N4-ar5ms-W2-zero1.json").read_text())
    assert data["config"]["data_parallel"] == 2 and "W=2" in r.stdout
    c, lat = cfg(), data["latency"]
    # chimera's two strategies, ours' 1F1B, torch's 1F1B and ZBV, each also sharded
    got = data["results"]
    assert len(got) == 10 and len({round(x["first_loss"], 6) for x in got}) == 1
    assert sum(1 for x in got if x["options"].get("shard")) == 5
    for x in got:
        impl, name = x["impl"], x["schedule"]
        s = (our_schedule(c, Row(impl, name, tuple(x["options"].items()))) if impl == "chimera"
             else torch_order(name, 2, 4))
        by_hand = dataclasses.replace(_by_hand(s, c, lat), shard_optimizer="shard" in x["options"])
        want = simulate(lower(s, "eager"), by_hand).makespan
        assert x["simulated_step_s"] == pytest.approx(want, rel=1e-9) and x["median_step_s"] > 0
    assert prices.priced(c)
