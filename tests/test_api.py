"""The bring-your-own-model API gives single-device gradients for a plain list of layers."""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import chimera.api as chimera
from ranks import run_ranks
from limits import limit

ROOT = os.path.join(os.path.dirname(__file__), "..")


def make_layers():
    return [nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12),
            nn.Tanh(), nn.Linear(12, 2)]


def batch():
    g = torch.Generator().manual_seed(7)
    return torch.randn(16, 6, generator=g, dtype=torch.float64), \
        torch.randn(16, 2, generator=g, dtype=torch.float64)


def reference_grads():
    torch.manual_seed(0)
    model = nn.Sequential(*make_layers()).double()
    x, y = batch()
    nn.functional.mse_loss(model(x), y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def make_layers64():
    return [layer.double() for layer in make_layers()]


SCHEDULES = ["chimera", "1f1b", "gpipe"]


def _worker(rank, world) -> dict:
    out = {}
    for schedule in SCHEDULES:
        pipe = chimera.Pipeline(make_layers64, nn.functional.mse_loss, schedule=schedule, stages=2,
                                micro_batches=4, micro_batch_size=4,
                                example_input=torch.zeros(1, 6, dtype=torch.float64))
        pipe.step(*batch())
        grads = {}
        for (p_, stage), module in pipe.runtime.modules.items():
            for name, param in module.named_parameters():
                grads[(p_, stage, name)] = param.grad.clone()
        out[schedule] = grads
    return out


def _by_schedule(got: list[dict]) -> dict:
    return {s: [r[s] for r in got] for s in SCHEDULES}


@pytest.fixture(scope="module")
def byo_grads():
    return _by_schedule(run_ranks(_worker, 2))  # virtual ranks; on processes: below


def _check(got):
    ref = reference_grads()  # stage parameters carry model-wide names ("4.weight")
    seen = 0
    for rank_grads in got:
        for (pipe, stage, name), g in rank_grads.items():
            assert torch.allclose(g, ref[name], rtol=1e-10, atol=1e-12), (pipe, stage, name)
            seen += 1
    return seen


def test_byo_chimera_gradients_equal_single_device(byo_grads):
    assert _check(byo_grads["chimera"]) == 2 * 8  # two replicas of every parameter


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_byo_one_directional_gradients_equal_single_device(byo_grads, schedule):
    assert _check(byo_grads[schedule]) == 8


@pytest.mark.slow
def test_byo_gradients_on_spawned_gloo_processes():
    """The same runs on real processes (the API's spawn, gloo): the same gradients."""
    got = _by_schedule(run_ranks(_worker, 2, processes=True))
    assert [_check(got[s]) for s in SCHEDULES] == [2 * 8, 8, 8]


@pytest.mark.slow
def test_example_runs(cli_env):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "byo_model.py")],
                       capture_output=True, text=True, timeout=limit(300), env=cli_env)
    assert r.returncode == 0, r.stderr
    losses = [float(l.split()[-1]) for l in r.stdout.splitlines() if l.startswith("step")]
    assert len(losses) == 5 and losses[-1] < losses[0]
