"""The emulated bench's prices (issue 36): per-layer costs, the two cuts, slow links and
gradient collectives reach the rows and every simulated column (no timing is asserted)."""

import json
import time

import pytest
import torch

from chimera.bench import prices
from chimera.bench.emulated import our_schedule, simulated
from chimera.bench.links import LateSends, PricedTransport
from chimera.bench.rows import BenchConfig, Row
from chimera.cli import build_parser, main
from chimera.cli.bench_cmd import _stem, config_from_args
from chimera.errors import UserError
from chimera.ir import Placement
from chimera.passes import lower
from chimera.schedules import build
from chimera.sim import simulate

LAT = {"p2p_s": 0.0, "allreduce_s": 0.0}


def cfg(**kw) -> BenchConfig:
    return BenchConfig(**{"emulate": "1:2:1", "stages": 4, "micro_batches": 8, **kw})


def step(c: BenchConfig, name: str) -> float:
    return simulated(build(name, c.stages, c.micro_batches), c, LAT)["simulated_step_s"]


def test_layer_weights_put_the_head_and_embedding_on_the_last_and_first_layer():
    w = prices.layer_weights(cfg(head=1.5, embed=1.25, layers_per_stage=4))
    assert len(w) == 16 and w[1:-1] == [0.25] * 14
    assert w[0] == pytest.approx(0.5) and w[-1] == pytest.approx(0.75)
    assert sum(w) == pytest.approx(4 + 0.5 + 0.25)


def test_the_equal_cut_and_the_cut_for_each_placements_ranks():
    c = cfg(head=2.0, layers_per_stage=4, stages=8, partition="layers")
    assert [len(r) for r in prices.cut(c, Placement.v(8), (0,) * 16)] == [2] * 16
    c = cfg(head=2.0, layers_per_stage=4, stages=8, partition="cost")
    w = prices.layer_weights(c)
    for placement, pipes in ((Placement.chimera(8), (0, 1) * 8), (Placement.v(8), (0,) * 16),
                             (Placement.linear(8), (0,) * 16)):
        ranges = prices.cut(c, placement, pipes)
        assert [i for r in ranges for i in r] == list(range(32))
        load = [sum(sum(w[i] for i in ranges[s]) * share for s, share in held)
                for held in prices.held_shares(placement, pipes)]
        equal = [sum(sum(w[i] for i in range(4 * s // (placement.stages // 8), 4 * (s + 1)
                                                // (placement.stages // 8))) * share
                     for s, share in held) for held in prices.held_shares(placement, pipes)]
        assert max(load) <= max(equal) + 1e-12
    # Chimera splits the head over the two ranks that hold the last stage: 9 D-ths on 8 ranks
    ranges = prices.cut(c, Placement.chimera(8), (0, 1) * 8)
    loads = [sum(sum(w[i] for i in ranges[s]) * share for s, share in held)
             for held in prices.held_shares(Placement.chimera(8), (0, 1) * 8)]
    assert max(loads) == pytest.approx(9 / 8)


def test_a_heavier_head_and_a_slower_link_lengthen_the_simulated_step_as_priced():
    # GPipe with one micro-batch is a chain: F0 F1 B1 B0, two hops
    base = cfg(stages=2, micro_batches=1, emulate="1:2:1")
    free = step(base, "gpipe")
    assert free == pytest.approx(2 * 4e-3)
    assert step(cfg(stages=2, micro_batches=1, link_ms=3.0), "gpipe") == pytest.approx(free + 6e-3)
    # the last D-th twice as heavy: its F, I and W twice as long
    assert step(cfg(stages=2, micro_batches=1, head=2.0), "gpipe") == pytest.approx(free + 4e-3)


def test_gradient_allreduce_is_priced_by_the_layers_a_stage_holds():
    """W=1: only Chimera's replicas reduce; each stage's collective takes allreduce_ms per
    D-th of layers; W=2: every schedule's does."""
    c = cfg(allreduce_ms=10.0)
    t = simulated(build("chimera", 4, 8), c, LAT)["timeline"]
    assert t.collectives and all(e - s == pytest.approx(10e-3) for _, _, s, e in t.collectives)
    assert step(c, "1f1b") == pytest.approx(step(cfg(), "1f1b"))
    t = simulated(build("zb-v", 4, 8), cfg(allreduce_ms=10.0, data_parallel=2), LAT)["timeline"]
    assert t.collectives and all(e - s == pytest.approx(5e-3) for _, _, s, e in t.collectives)
    assert step(cfg(allreduce_ms=10.0, data_parallel=2), "1f1b") > step(cfg(), "1f1b")


def test_chimera_zb_is_told_the_priced_costs():
    row = Row("chimera", "chimera-zb")
    assert our_schedule(cfg(), row).params["cost"] != "custom"  # unpriced: as before
    told = our_schedule(cfg(head=2.0, layers_per_stage=4), row)
    assert told.params["cost"] == "custom"
    c = cfg(head=2.0, layers_per_stage=4)
    blind = build("chimera-zb", 4, 8)
    assert step(c, "chimera") > 0
    assert (simulated(told, c, LAT)["simulated_step_s"]
            <= simulated(blind, c, LAT)["simulated_step_s"] + 1e-12)


def test_bad_prices_are_refused_in_one_line():
    for kw in ({"head": 0.5}, {"link_ms": -1.0}, {"partition": "even"}, {"layers_per_stage": 0},
               {"data_parallel": 0}):
        with pytest.raises(UserError):
            cfg(**kw)
    with pytest.raises(UserError, match="emulated stages only"):
        BenchConfig(head=2.0)
    with pytest.raises(UserError, match="cannot be cut into 8 equal stages"):
        prices.cut(cfg(layers_per_stage=3), Placement.v(4), (0,) * 8)


def test_the_cli_passes_the_prices_and_names_its_files(tmp_path, capsys):

    args = build_parser().parse_args(
        ["bench", "--emulate", "1:2:1", "-D", "4", "--head", "1.5", "--partition", "cost",
         "--layers-per-stage", "4", "--link-ms", "2", "--allreduce-ms", "3"])
    c = config_from_args(args)
    assert (c.head, c.partition, c.layers_per_stage, c.link_ms, c.allreduce_ms) == (1.5, "cost", 4, 2.0, 3.0)
    assert _stem(c) == "bench-emulated-D4-N8-head1.5-L4-cost-link2ms-ar3ms"
    assert "--head 1.5" in c.extra["command"] and "--partition cost" in c.extra["command"]
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--head", "2", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "emulated stages only" in capsys.readouterr().err


class _Work:
    def __init__(self):
        self.future = torch.futures.Future()
        self.future.set_result(None)

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def get_future(self):
        return self.future


class _Inner:
    def __init__(self):
        self.sent = []

    def isend(self, tensor, dst, tag=0, group=None):
        self.sent.append((time.perf_counter(), int(tensor.item())))
        return _Work()

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        return _Work()


def test_late_sends_go_in_order_no_earlier_than_the_link_and_allreduces_as_priced():
    inner = _Inner()
    t = PricedTransport(inner, LateSends(0.01), seconds_per_float=0.001)
    start = time.perf_counter()
    works = [t.isend(torch.tensor(k), 1) for k in range(3)]
    assert all(w.wait() for w in works)
    assert [k for _, k in inner.sent] == [0, 1, 2]
    assert all(at >= start + 0.01 for at, _ in inner.sent)
    start = time.perf_counter()
    work = t.all_reduce(torch.zeros(5), group="stage", async_op=True)
    assert work.wait() and time.perf_counter() >= start + 0.005
    assert t.all_reduce(torch.zeros(5)).__class__ is _Work  # the loss's, not a gradient sync


@pytest.mark.slow
def test_bench_emulate_runs_every_price_on_ours_and_torchs(run_cli, tmp_path):
    rows = "chimera:chimera,chimera:chimera-zb,torch:1f1b,torch:zbv,torch:dualpipev,floor:chimera"
    r = run_cli("bench", "--emulate", "2:2:2", "-D", "2", "-N", "4", "--steps", "1", "--warmup", "0",
                "--rows", rows, "--head", "1.5", "--layers-per-stage", "4", "--partition", "cost",
                "--link-ms", "1", "--allreduce-ms", "4", "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    stem = "bench-emulated-D2-N4-head1.5-L4-cost-link1ms-ar4ms"
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    c = data["config"]
    assert (c["head"], c["partition"], c["link_ms"], c["allreduce_ms"]) == (1.5, "cost", 1.0, 4.0)
    got = {(x["impl"], x["schedule"]): x for x in data["results"]}
    assert len(got) == 6
    for x in got.values():  # the priced link is in every simulated step
        assert x["simulated_step_s"] >= x["simulated_free_s"] + 2e-3 and x["median_step_s"] > 0
    assert "Priced alike on every row" in r.stdout


def _replica_allreduce(k: float, w: int = 1) -> BenchConfig:
    return BenchConfig(emulate="20:20:20", stages=8, micro_batches=16, layers_per_stage=4,
                       allreduce_ms=k * 20 * 16 / 8, data_parallel=w)


@pytest.mark.parametrize("k, w", [(0.5, 1), (2.0, 1), (2.0, 2)])
def test_chimera_zb_drains_a_stage_so_its_allreduce_overlaps_the_rest(k, w):
    """Told the stages' allreduces, chimera-zb plays variants that finish one stage's W's
    first and keeps the play that is shortest with its allreduces (D=8 N=16, 2 F*N/D per
    D-th: 1.10 s against 1.18 s ordered blind to them)."""
    c = _replica_allreduce(k, w)
    aware = simulated(our_schedule(c, Row("chimera", "chimera-zb")), c, LAT)["simulated_step_s"]
    blind = simulated(build("chimera-zb", 8, 16, cost=prices.cost_model(
        BenchConfig(emulate="20:20:20", stages=8, micro_batches=16, layers_per_stage=4),
        build("chimera-zb", 8, 16), 20e-3, 20e-3, 20e-3)), c, LAT)["simulated_step_s"]
    assert aware < blind


def test_ours_at_least_torchs_best_in_the_allreduce_rows():
    """Issue 36's allreduce rows at D=8 N=16 (simulated): our best schedule is at least
    torch's best (at W=1 V holds one copy and reduces nothing: our zb-v and DualPipeV, the
    same placement, equal it; Chimera's placement pays its replica allreduce)."""
    from chimera.bench.regimes import Regime, best, simulate_regime

    for k, w in ((0.5, 1), (2.0, 1), (0.5, 2), (2.0, 2)):
        regime = Regime("allreduce", (("allreduce_ms", k * 20 * 16 / 8), ("data_parallel", w)))
        sides = simulate_regime(regime, BenchConfig(emulate="20:20:20", stages=8, micro_batches=16,
                                                    layers_per_stage=4))
        assert best(sides["ours"], None)[1] <= best(sides["torch"], None)[1] + 1e-9, (k, w)


def test_the_regime_table_lists_the_issues_rows_and_leaves_realized_cells_unmeasured():
    from chimera.bench import regimes

    rows = regimes.regimes(20.0, 8, 16)
    assert len(rows) == 16 and rows[0].label == "balanced"
    assert dict(rows[12].prices) == {"allreduce_ms": 80.0, "data_parallel": 2}
    assert dict(rows[14].prices)["shard_optimizer"] and dict(rows[15].prices)["head_params"] == 1.5
    base = BenchConfig(emulate="20:20:20", stages=8, micro_batches=16, layers_per_stage=4)
    words = regimes.bench_command(base, rows[2], quick=True)
    assert words[:2] == ["chimera", "bench"] and "--partition" in words and words[-1] == "--quick"
    words = regimes.bench_command(base, rows[14], quick=False)  # W=2: two pipeline copies
    assert words[words.index("--data-parallel") + 1] == "2" and "--shard-optimizer" in words
    fake = [{"regime": r.label, "realized": None,
             "ours": ("chimera-zb", 1.0), "bidirectional": ("chimera-zb", 1.0),
             "torch": ("zbv", 1.1), "simulated_ratio": 1.1, "bidirectional_ratio": 1.1} for r in rows]
    text = regimes.markdown(fake, base)
    assert text.count(regimes.NOT_MEASURED) == 16 and "1.10x" in text
    assert regimes.markdown(fake, base, short=True).count("\n") == 17


def test_torchs_orders_are_simulated_without_processes():
    from chimera.bench.rows import TORCH_SCHEDULES
    from chimera.bench.torch_orders import torch_order
    from chimera.check.validate import validate

    for name in TORCH_SCHEDULES:
        s = torch_order(name, 4, 8)
        validate(s)  # DualPipeV's mixes whole and split backwards
        assert simulate(lower(s)).makespan > 0


def test_head_and_embedding_gradients_are_carried_by_the_layers_and_priced_alike():
    """--head-params / --embed-params: the last and first layers carry their D-ths of the
    gradients (extra floats on the emulated layer); a stage's allreduce is priced by the
    floats it holds, in the simulated column and by the rows' transport alike."""
    from chimera.bench.emulated import cost_of, priced_context
    from chimera.models.emulated import emulated_layers, emulated_pieces
    from chimera.runtime.context import RunContext

    c = cfg(head_params=2.0, embed_params=1.5, layers_per_stage=2, allreduce_ms=10.0)
    floats = prices.layer_params(c)
    assert floats == [16 + 16, 16, 16, 16, 16, 16, 16, 16 + 32]
    make = emulated_layers(cost_of(c), 4, 8, extra=prices.extra_params(c))
    assert [sum(p.numel() for p in make(i).parameters()) for i in range(8)] == floats
    # a fused stage (the floor's) carries its layers' floats too
    piece = emulated_pieces(cost_of(c), [range(6, 8)], prices.layer_weights(c),
                            extra=prices.extra_params(c))(0)
    assert sum(p.numel() for p in piece.parameters()) == 2 * 16 + 32
    t = simulated(build("chimera", 4, 8), c, LAT)["timeline"]
    took = {stage: e - s for _, stage, s, e in t.collectives}
    assert took == pytest.approx({0: 15e-3, 1: 10e-3, 2: 10e-3, 3: 20e-3})
    # the rows' transport charges the same per float
    per_float = priced_context(c, RunContext(_Inner())).transport.seconds_per_float
    assert per_float * (floats[6] + floats[7]) == pytest.approx(took[3])
    assert step(cfg(head_params=2.0), "1f1b") == pytest.approx(step(cfg(), "1f1b"))  # W=1: none


def test_the_extra_gradient_floats_take_no_part_in_the_value_and_get_zero_gradients():
    from chimera.bench.emulated import cost_of
    from chimera.models.emulated import EmulatedLayer

    plain = EmulatedLayer(cost_of(cfg(emulate="0.001:0.001:0.001")), 1.0, seed=3, index=2)
    heavy = EmulatedLayer(cost_of(cfg(emulate="0.001:0.001:0.001")), 1.0, seed=3, index=2, extra=40)
    x = torch.randn(2, prices.WIDTH, requires_grad=True)
    y = heavy(x)
    assert torch.equal(y, plain(x))
    y.sum().backward()
    assert heavy.extra.grad is not None and torch.equal(heavy.extra.grad, torch.zeros(40))
    with pytest.raises(UserError, match="extra parameters"):
        EmulatedLayer(cost_of(cfg()), 1.0, extra=-1)
