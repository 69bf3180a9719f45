"""Accelerator-like layers (chimera.models.emulated) and `chimera bench --emulate`.

- each wait lands where the issue puts it: forward F, input-gradient path I, weight path W,
  a full backward I + W, the first layer's (no input gradient) backward all on its weight
  path, scaled by rows and by the layer's share of a stage (on a fake clock: sleep is
  recorded, not timed); the layer's own host code runs inside its wait (a wait ends a set
  time after the host entered the layer), the code before it does not;
- the layers give the gradients of the same model without waits, through the pipeline
  (gloo, 2 ranks, split and unsplit schedules), and a plain y = x + bias in one process;
- a fused layer (the floor's stage) computes what its layers compute and waits what they
  wait, once per action; the floor runs our row's program through the same runtime, one wait
  per action at its simulated cost, with the same message and gradient bytes;
- the bench's emulated rows run (tiny waits, D=2), floor rows too, and report what the issue
  asks, with peak activations measured where the simulator counts them (no time is asserted).
"""

import dataclasses
import functools
import json
import os

import pytest
import torch
from torch import nn

from chimera.errors import UserError
from chimera.models import emulated
from chimera.models.emulated import (EmulatedCost, EmulatedLayer, emulated_batch, emulated_layers,
                                     emulated_stages)
from chimera.runtime.split_backward import backward_input, backward_weight
from limits import limit


class FakeClock:
    """``time`` for the emulated layers: ``perf_counter`` advances only by ``sleep`` and by
    ``tick`` per call (host code taking time); every sleep is recorded."""

    def __init__(self, tick: float = 0.0):
        self.now, self.tick, self.sleeps = 100.0, tick, []

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(emulated, "time", fake)
    return fake


@pytest.fixture
def waits(clock):
    """The seconds each sleep of the emulated layers asked for, in order (no real sleeping;
    no time passes but the sleeps', so each sleep is a whole wait)."""
    return clock.sleeps


COST = EmulatedCost(0.003, 0.005, 0.007, rows=4, activation_bytes=1000)


def test_parse_and_refuse():
    assert EmulatedCost.parse("20:20:20").input_grad_s == pytest.approx(0.02)
    c = EmulatedCost.parse("10:30")
    assert (c.forward_s, c.input_grad_s, c.weight_grad_s) == pytest.approx((0.01, 0.015, 0.015))
    for bad in ("", "1", "1:2:3:4", "a:b", "-1:2", "1:nan"):
        with pytest.raises(UserError):
            EmulatedCost.parse(bad)


def test_forward_and_full_backward_wait_f_then_i_plus_w(waits, clock):
    layer = EmulatedLayer(COST, share=1.0)
    x = torch.randn(4, COST.width, requires_grad=True)
    y = layer(x)
    assert waits == pytest.approx([0.003])
    t0 = clock.now
    y.sum().backward()
    # I and W queued back to back: one backward of I + W, whichever node autograd runs first
    assert sum(waits[1:]) == pytest.approx(0.012) and clock.now - t0 == pytest.approx(0.012)


def test_the_layers_own_host_code_runs_inside_its_wait(monkeypatch):
    fake = FakeClock(tick=1e-4)  # every clock read: 0.1 ms of host code
    monkeypatch.setattr(emulated, "time", fake)
    layer = EmulatedLayer(COST, share=1.0)
    x = torch.randn(4, COST.width, requires_grad=True)
    layer(x)  # warm: nothing below depends on a first call
    t0 = fake.perf_counter()
    y = layer(x)
    # the forward ends F after the host entered it (the one read after the sleep aside), and
    # the wait itself is shorter than F by the host time the layer spent before it
    assert fake.now - t0 == pytest.approx(0.003, abs=3e-4)
    assert fake.sleeps[-1] < 0.003
    t0 = fake.perf_counter()
    y.sum().backward()
    assert fake.now - t0 == pytest.approx(0.012, abs=5e-4)


def test_host_time_before_a_layer_is_not_hidden(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(emulated, "time", fake)
    layer = EmulatedLayer(COST, share=1.0)
    x = torch.randn(4, COST.width)
    layer(x)
    fake.now += 0.05  # the runtime's own code between two layers: 50 ms
    t0 = fake.now
    layer(x)
    assert fake.now - t0 == pytest.approx(0.003)  # a full F after the host got there


def test_a_recomputation_that_stops_early_queues_no_forward(clock):
    """Checkpointing recomputes the last layer's forward only up to the tensor it saves: that
    partial forward queues nothing on the layer's device (its W would wait behind a forward
    nobody waited for), so the checkpointed backward takes what it took before forwards were
    committed at the layer's end: that of the plain backward here."""
    from torch.utils.checkpoint import checkpoint

    def stage():
        torch.manual_seed(0)
        return nn.Sequential(EmulatedLayer(COST, 0.5, index=0), EmulatedLayer(COST, 0.5, index=1))

    x = torch.randn(4, COST.width, requires_grad=True)
    plain = stage()(x)
    t0 = clock.now
    plain.sum().backward()
    plain_s, expected = clock.now - t0, x.grad.clone()
    x.grad = None
    y = checkpoint(stage(), x, use_reentrant=False)
    t0 = clock.now
    y.sum().backward()
    assert clock.now - t0 == pytest.approx(plain_s) and plain_s == pytest.approx(0.012)
    assert torch.equal(x.grad, expected)


def test_split_backward_waits_i_in_i_and_w_in_w(waits):
    layers = nn.Sequential(EmulatedLayer(COST, 0.5, index=0), EmulatedLayer(COST, 0.5, index=1))
    x = torch.randn(4, COST.width, requires_grad=True)
    y = layers(x)
    assert waits == pytest.approx([0.0015, 0.0015])  # half a stage each
    waits.clear()
    dx, pending = backward_input(y, x, torch.ones_like(y), list(layers.parameters()))
    assert waits == pytest.approx([0.0025, 0.0025]) and torch.equal(dx, torch.ones_like(x))
    waits.clear()
    backward_weight(pending)
    assert waits == pytest.approx([0.0035, 0.0035])
    assert all(torch.equal(p.grad, torch.full_like(p, 4.0)) for p in layers.parameters())


def test_no_input_gradient_puts_the_whole_backward_on_the_weight_path(waits):
    layer = EmulatedLayer(COST, share=1.0)
    y = layer(torch.randn(4, COST.width))  # a first stage's input: no gradient
    waits.clear()
    y.sum().backward()
    assert waits == pytest.approx([0.012])


def test_waits_scale_with_rows(waits):
    layer = EmulatedLayer(COST, share=1.0)
    layer(torch.randn(2, COST.width, requires_grad=True)).sum().backward()  # a halved micro-batch
    assert waits[0] == pytest.approx(0.0015) and sum(waits[1:]) == pytest.approx(0.006)
    waits.clear()
    layer(torch.randn(8, COST.width))  # two micro-batches at once
    assert waits == pytest.approx([0.006])


def test_activation_is_kept_until_backward():
    from chimera.bench.runners import ActivationMeter

    layer = EmulatedLayer(COST, share=1.0)
    meter = ActivationMeter(list(layer.parameters()))
    with meter.hooks():
        y = layer(torch.randn(4, COST.width, requires_grad=True))
        assert meter.live >= COST.activation_bytes
        y.sum().backward()
    assert meter.live == 0 and meter.peak >= COST.activation_bytes


def test_a_cut_must_be_equal():
    with pytest.raises(UserError):
        emulated_layers(COST, stages=3, layers=4)
    with pytest.raises(UserError):
        emulated_stages(COST, stages=2, layers=4, pieces=3)


def test_a_fused_layer_computes_and_waits_what_its_layers_do(waits):
    """The floor's stage: layers 2 and 3 of a 4-layer, 2-stage model fused into one layer."""
    make, fused = emulated_layers(COST, 2, 4, seed=5), emulated_stages(COST, 2, 4, 2, seed=5)(1)
    pair = nn.Sequential(make(2), make(3))
    assert fused.bias.shape == (2, COST.width) and fused.share == pytest.approx(1.0)
    assert torch.equal(fused.bias, torch.stack([pair[0].bias, pair[1].bias]))
    x = torch.randn(4, COST.width, requires_grad=True)
    xf = x.detach().clone().requires_grad_()
    y = pair(x)
    waits.clear()
    yf = fused(xf)
    assert waits == pytest.approx([0.003])  # one wait: the stage's whole F
    assert torch.allclose(yf, y, atol=1e-7)
    waits.clear()
    dx, pending = backward_input(yf, xf, torch.ones_like(yf), [fused.bias])
    assert waits == pytest.approx([0.005])
    waits.clear()
    backward_weight(pending)
    assert waits == pytest.approx([0.007])
    y.backward(torch.ones_like(y))
    assert torch.equal(dx, x.grad)
    assert all(torch.equal(fused.bias.grad[k], pair[k].bias.grad) for k in range(2))


FLOOR_CFG = dict(emulate="1:2:3", stages=2, micro_batches=4, micro_batch_size=2,
                 activation_mb=0.01)


def _floor_worker(rank, world) -> dict:
    from chimera.bench.emulated import EmulatedFloor, EmulatedOurs, stage_costs
    from chimera.bench.rows import BenchConfig, Row
    from chimera.check.comm_plan import Message
    from chimera.ir import Op
    from chimera.runtime.context import RunContext

    cfg, context, out = BenchConfig(**FLOOR_CFG), RunContext.here(), {}
    for schedule in ("zb-v", "1f1b", "chimera"):
        ours = EmulatedOurs(cfg, Row("chimera", schedule), context)
        floor = EmulatedFloor(cfg, Row("floor", schedule), context)
        first = ours.step(0)
        o, f = ours.pipe.runtime, floor.runtime
        sends = [a for a in f.program if getattr(a, "op", None) in (Op.SEND_F, Op.SEND_B)]
        s = floor.schedule
        costs = stage_costs(s, 1e-3, 2e-3, 3e-3)
        asked = {"F": 0.0, "I": 0.0, "W": 0.0}
        for a in f.program:  # what the simulator prices each compute action at, by kind
            if getattr(a, "op", None) in (Op.F, Op.B, Op.I, Op.W):
                asked["F"] += costs.f[a.stage] if a.op is Op.F else 0.0
                asked["I"] += costs.i[a.stage] if a.op in (Op.B, Op.I) else 0.0
                asked["W"] += costs.w[a.stage] if a.op in (Op.B, Op.W) else 0.0
        floor.log.totals.clear()
        built = floor.step(1)  # the loss of the step run when the row was built
        waited = {k: v[1] for k, v in floor.log.totals.items()}
        out[schedule] = {
            "same_program": f.program == o.program and s == ours.schedule,
            "same_messages": [f.message_shape(Message.of(a, s.stages)) ==
                              o.message_shape(Message.of(a, s.stages)) for a in sends],
            "same_grad_floats": {k: g.flat.numel() for k, g in f.grads.items()} ==
                                {k: g.flat.numel() for k, g in o.grads.items()},
            "floor_modules": [len(list(m.children())) for m in f.modules.values()],
            "losses": (built, first, floor.step(2)), "asked": asked, "waited": waited,
        }
    return out


def test_the_floor_runs_our_program_through_the_runtime_at_the_simulated_costs():
    from ranks import run_ranks

    for rank in run_ranks(_floor_worker, 2):
        for schedule, got in rank.items():
            assert got["same_program"] and all(got["same_messages"]) and got["same_messages"]
            assert got["same_grad_floats"], schedule
            assert set(got["floor_modules"]) == {1}, schedule  # one (fused) layer a stage
            built, first, later = got["losses"]
            assert built == pytest.approx(first, rel=1e-6) and later is None
            # every wait asked exactly what the simulator prices its action at
            asked = {k: v for k, v in got["asked"].items() if v}
            assert got["waited"] == pytest.approx(asked), schedule


SCHEDULES = ("chimera", "zb-v", "1f1b", "dualpipev")


def _pipeline_worker(rank, world) -> dict:
    import chimera.api as api  # here: the module's other tests need no runtime

    cost = EmulatedCost(0.001, 0.001, 0.001, rows=2, activation_bytes=64)
    grads = {}
    for schedule in SCHEDULES:
        make = emulated_layers(cost, stages=2, layers=4, seed=3)
        pipe = api.Pipeline(make, nn.functional.mse_loss, schedule=schedule, stages=2,
                            micro_batches=4, micro_batch_size=2,
                            model=api.ModelOptions(num_layers=4))
        pipe.step(*emulated_batch(cost, 8, step=0, seed=3))
        grads[schedule] = {name: p.grad.clone() for name, p in pipe.named_parameters()}
    return grads


def test_pipelined_gradients_equal_one_process_without_waits():
    from ranks import run_ranks  # here: beside the import of the API it runs

    got = run_ranks(_pipeline_worker, 2)  # virtual ranks: the layers, not the transport
    free = EmulatedCost(0.0, 0.0, 0.0, rows=2)
    model = nn.Sequential(*[emulated_layers(free, 2, 4, seed=3)(i) for i in range(4)])
    x, y = emulated_batch(free, 8, step=0, seed=3)
    nn.functional.mse_loss(model(x), y).backward()
    ref = {n: p.grad for n, p in model.named_parameters()}
    # y = x + sum of biases: every bias gets the same gradient, 2 (out - y) / numel summed over rows
    plain = 2 * (x + sum(p.detach() for p in model.parameters()) - y).sum(0) / y.numel()
    assert torch.allclose(ref["0.bias"], plain, atol=1e-7)
    for schedule in SCHEDULES:
        seen = set()
        for rank_grads in got:
            for name, g in rank_grads[schedule].items():
                assert torch.allclose(g, ref[name], atol=1e-7), (schedule, name)
                seen.add(name)
        assert seen == set(ref), schedule


@pytest.mark.slow
def test_bench_emulate_rows(run_cli, tmp_path):
    rows = "chimera:chimera,chimera:zb-v,chimera:1f1b,torch:1f1b,torch:zbv,torch:dualpipev," \
           "floor:zb-v,floor:1f1b"
    r = run_cli("bench", "--emulate", "2:2:2", "-D", "2", "-N", "4", "--steps", "1",
                "--warmup", "0", "--rows", rows, "--activation-mb", "0.25", "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "bench-emulated-D2-N4.json").read_text())
    assert data["config"]["emulate_ms"] == "2:2:2" and data["latency"]["p2p_s"] > 0
    got = {(x["impl"], x["schedule"]): x for x in data["results"]}
    assert set(got) == {("chimera", "chimera"), ("chimera", "zb-v"), ("chimera", "1f1b"),
                        ("torch", "1f1b"), ("torch", "zbv"), ("torch", "dualpipev"),
                        ("floor", "zb-v"), ("floor", "1f1b")}
    for key in (("floor", "zb-v"), ("floor", "1f1b")):  # our program on null-compute stages
        floor = got[key]
        assert floor["peak_activations"] is None and floor["realized_vs_simulated"] > 0
        # it runs our row's lowered program: the same order is simulated for both
        assert floor["simulated_step_s"] == pytest.approx(got[("chimera", key[1])]["simulated_step_s"], rel=1e-9)
        mine = got[("chimera", key[1])]
        assert mine["realized_vs_floor"] == pytest.approx(mine["median_step_s"] / floor["median_step_s"])
        # its first step (an API step, run when it was built) is the fused model's: our row's loss
        assert floor["first_loss"] == pytest.approx(mine["first_loss"])
    for key in (("floor", "zb-v"), ("floor", "1f1b")):  # a full backward waits I, then W
        assert set(got[key]["wait_stretch"]) == {"F", "I", "W"}
    assert got[("chimera", "chimera")]["realized_vs_floor"] is None  # no floor row was asked for
    assert data["summary"]["floor"]["floor_vs_simulated"][0] > 0
    for x in data["results"]:
        if x["impl"] == "floor":
            continue
        assert x["stages"] == 2 and x["micro_batches"] == 4
        assert x["simulated_free_s"] > 0 and x["simulated_step_s"] >= x["simulated_free_s"]
        assert x["realized_vs_simulated"] == pytest.approx(x["median_step_s"] / x["simulated_step_s"])
        # a wait the host reached after its due time took exactly what it asked (up to rounding)
        assert set(x["wait_stretch"]) == {"F", "I", "W"} and min(x["wait_stretch"].values()) >= 1 - 1e-6
        assert x["simulated_measured_waits_s"] >= x["simulated_step_s"]
        assert len(x["peak_activations"]) == 2
    for key in (("chimera", "chimera"), ("chimera", "zb-v"), ("chimera", "1f1b"), ("torch", "1f1b"),
                ("torch", "dualpipev")):  # (its order mixes B with I/W)
        # activations live exactly as long as the simulator counts them (in Ma per rank)
        assert got[key]["peak_activations"] == got[key]["simulated_peak_activations"], key
    assert got[("chimera", "1f1b")]["peak_activations"] == [2, 1]  # 1F1B: D Ma on rank 0
    trace = json.loads((tmp_path / "bench-emulated-D2-N4-traces" / "chimera_zb-v.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"F L0", "W L0"} <= names and any(n.startswith("p0s") for n in names)
    trace = json.loads((tmp_path / "bench-emulated-D2-N4-traces" / "floor_zb-v.json").read_text())
    assert any(e["name"].startswith("W") for e in trace["traceEvents"] if e["ph"] == "X")
    assert (tmp_path / "bench-emulated-D2-N4.png").stat().st_size > 0
    assert "realized / simulated" in r.stdout


def test_bench_emulate_refuses_bad_times(tmp_path, capsys):
    from chimera.cli import main  # here: the CLI in this process, as `chimera bench` runs it

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--emulate", "20:x", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--emulate" in err and "Traceback" not in err


def test_spinning_waits_never_sleep_and_end_at_their_deadline(monkeypatch):
    """``spin=True``: the host busy-waits (each perf_counter call takes a tick here) until the
    same deadline a sleep would end at; ``spin=False`` sleeps it."""
    for spin in (True, False):
        fake = FakeClock(tick=1e-5)
        monkeypatch.setattr(emulated, "time", fake)
        layer = EmulatedLayer(dataclasses.replace(COST, spin=spin), share=1.0)
        start = fake.now
        layer(torch.zeros(4, COST.width))
        assert fake.now - start >= COST.forward_s
        assert (fake.sleeps == []) == spin
    with pytest.raises(UserError, match="spin"):
        EmulatedCost(0.001, 0.001, 0.001, spin="yes")


def test_bench_spin_is_refused_beyond_the_cores_and_without_emulate(tmp_path, capsys, monkeypatch):
    from chimera.cli import main

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    for argv in (["--emulate", "1:1:1", "-D", "4", "--spin"], ["--spin"]):
        with pytest.raises(SystemExit) as exc:
            main(["bench", *argv, "--out", str(tmp_path)])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "spin" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="prctl is Linux's")
def test_timer_slack_is_tightened_on_linux():
    import ctypes

    libc = ctypes.CDLL(None)
    before = libc.prctl(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK
    try:
        assert emulated.tighten_timer_slack() is True
        assert libc.prctl(30, 0, 0, 0, 0) == 1
    finally:
        libc.prctl(29, before, 0, 0, 0)  # this pytest process's own slack, as it was


@pytest.mark.slow
def test_wake_cost_script_writes_its_table(cli_env, tmp_path):
    """benchmarks/wake_cost.py (the README's figure for code run right after a sleep) runs and
    writes one row per sleep length, each with a first call, a second call and an isend time."""
    import socket
    import subprocess
    import sys

    from conftest import ROOT

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "wake_cost.py"), "--reps", "3",
                        "--out", str(tmp_path), "--port", str(port)],
                       env=cli_env, capture_output=True, text=True, timeout=limit(120))
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "wake_cost.json").read_text())
    assert [row["sleep_ms"] for row in data["piece"]] == [row["sleep_ms"] for row in data["isend"]]
    assert data["piece"][0]["sleep_ms"] == 0 and len(data["piece"]) >= 4
    assert all(row["first_us"] > 0 and row["second_us"] > 0 for row in data["piece"])
    assert all(row["isend_us"] > 0 for row in data["isend"])
    table = (tmp_path / "wake_cost.md").read_text().splitlines()
    assert len(table) == 2 + len(data["piece"]) and not (tmp_path / ".wake_cost_isend.json").exists()


@pytest.mark.slow
def test_bench_emulate_spin_rows(run_cli, tmp_path):
    """--spin: the same rows with busy-waiting stages, written under their own name."""
    r = run_cli("bench", "--emulate", "1:1:1", "-D", "2", "-N", "2", "--steps", "1", "--warmup", "0",
                "--rows", "chimera:1f1b,floor:1f1b", "--spin", "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "bench-emulated-D2-N2-spin.json").read_text())
    assert data["config"]["waits"] == "spin" and "--spin" in data["config"]["command"]
    assert {(x["impl"], x["schedule"]) for x in data["results"]} == {("chimera", "1f1b"), ("floor", "1f1b")}
    assert "spinning" in r.stdout and not (tmp_path / "bench-emulated-D2-N2.json").exists()
