"""`--eval-every`: the held-out loss is the single-process value on every layout, and
evaluating changes nothing about training (two virtual ranks run the layouts: evaluation, not
the transport, is the subject)."""

import functools
import json
import math
import os

import pytest
import torch

from chimera.train import ConfigError, TrainConfig
from chimera.train.launch import launch
from chimera.train.loop import Trainer
from ranks import run_ranks

F64 = dict(dtype="float64", steps=3, eval_every=2, eval_batches=2, micro_batch_size=2,
           progress=False)
LAYOUTS = {  # world 2; every one has the mini-batch of 8 sequences
    "chimera": dict(schedule="chimera", stages=2, micro_batches=4),
    "1f1b": dict(schedule="1f1b", stages=2, micro_batches=4),
    "w2": dict(schedule="1f1b", stages=1, data_parallel=2, micro_batches=2),
    "chimera-off": dict(schedule="chimera", stages=2, micro_batches=4, eval_every=0),
    "sharded-recompute": dict(schedule="chimera", stages=2, micro_batches=4, shard_optimizer=True,
                              recompute=True),
    "bert-halving": dict(model="bert-tiny", schedule="chimera", stages=2, micro_batches=4,
                         strategy="halving"),
    "bert-off": dict(model="bert-tiny", schedule="chimera", stages=2, micro_batches=4,
                     strategy="halving", eval_every=0),
}


def _cfg(data, **kw):
    return TrainConfig(data=data, **{**F64, **kw})


def _run(cfg, rank):
    """What ``chimera train`` does on one rank: (step, loss, val_loss) per step, parameters."""
    from chimera.train.launch import _train

    trainer = Trainer(cfg)
    logs = []
    _train(trainer, cfg, None, lambda t, step, log: logs.append(log))
    params = {n: p.detach().clone() for n, _, p in trainer.replica_parameters()}
    return [(l.step, l.loss, l.val_loss) for l in logs], params


def _worker(rank, world, root, data):
    out = {name: _run(_cfg(data, **kw), rank) for name, kw in LAYOUTS.items()}
    log = os.path.join(root, f"log.{rank}.jsonl")
    _run(_cfg(data, **LAYOUTS["chimera"], log_json=log if rank == 0 else None), rank)
    return out


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("layouts")
    return root, run_ranks(functools.partial(_worker, root=str(root), data=data), 2)


def _reference(data, **kw):
    """The single-process run of the same mini-batches."""
    cfg = _cfg(data, **{**kw, "schedule": "none", "stages": 1, "data_parallel": 1,
                        "micro_batches": 1, "micro_batch_size": 8, "strategy": None})
    return [(s["step"], s["loss"], s["val_loss"]) for s in launch(cfg)["steps"]]


def test_held_out_loss_is_the_same_on_every_layout(layouts, data):
    _, outs = layouts
    ref = _reference(data)
    assert [(s, v is not None) for s, _, v in ref] == [(0, False), (1, True), (2, True)]
    assert ref[1][2] > ref[2][2] > 0  # a real loss, lower after one more step
    for name in ("chimera", "1f1b", "w2", "sharded-recompute"):
        for rank in (0, 1):  # every rank returns the all-reduced value
            got = outs[rank][name][0]
            assert [(s, v is None) for s, _, v in got] == [(s, v is None) for s, _, v in ref]
            for (_, _, g), (_, _, r) in zip(got, ref):
                if r is not None:
                    assert g == pytest.approx(r, rel=1e-10, abs=0), name


def test_bert_held_out_loss_counts_every_masked_token_once(layouts, data):
    _, outs = layouts
    ref = _reference(data, model="bert-tiny")
    got = outs[0]["bert-halving"][0]
    for (_, _, g), (_, _, r) in zip(got, ref):
        assert (g is None) == (r is None)
        if r is not None:
            assert g == pytest.approx(r, rel=1e-10, abs=0)


@pytest.mark.parametrize("on, off", [("chimera", "chimera-off"), ("bert-halving", "bert-off")])
def test_evaluating_does_not_change_training(layouts, on, off):
    _, outs = layouts
    for rank in (0, 1):
        (with_eval, p_on), (without, p_off) = outs[rank][on], outs[rank][off]
        assert [(s, l) for s, l, _ in with_eval] == [(s, l) for s, l, _ in without]  # bit for bit
        assert all(v is None for _, _, v in without)
        assert p_on.keys() == p_off.keys()
        assert all(torch.equal(p_on[k], p_off[k]) for k in p_on)


def test_log_json_carries_the_held_out_loss(layouts):
    root, outs = layouts
    lines = [json.loads(l) for l in (root / "log.0.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [0, 1, 2]
    assert "val_loss" not in lines[0]
    assert [l["val_loss"] for l in lines[1:]] == [v for _, _, v in outs[0]["chimera"][0][1:]]
    assert all(l["eval_s"] > 0 for l in lines[1:])


# -- one process -------------------------------------------------------------------------
def test_evaluate_runs_in_eval_mode_and_touches_nothing(data):
    """Dropout on: evaluate() still gives the dropout-free loss, leaves gradients, optimizer
    state, the RNG and train mode as they were."""
    cfg = _cfg(data, schedule="none", stages=1, micro_batch_size=8, steps=2)
    t = Trainer(cfg)
    t.step(0)
    clean = t.evaluate()
    for m in t.model.modules():  # dropout everywhere: only train mode would use it
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.5
        if hasattr(m, "dropout") and isinstance(m.dropout, float):
            m.dropout = 0.5
    grads = [p.grad.clone() for p in t.params]
    state = [{k: v.clone() for k, v in t.optimizer.state[p].items()} for p in t.params]
    rng = torch.get_rng_state()
    assert t.evaluate() == clean
    assert t.model.training and all(m.training for m in t.model.modules())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(p.grad, g) for p, g in zip(t.params, grads))
    assert all(all(torch.equal(t.optimizer.state[p][k], v) for k, v in s.items())
               for p, s in zip(t.params, state))
    t.model.train()
    with torch.no_grad():
        noisy = t.model(t.batch(0, "val")[0])
        again = t.model(t.batch(0, "val")[0])
    assert not torch.equal(noisy, again)  # the dropout set above is real in train mode


def test_training_lowers_the_held_out_loss_on_a_repetitive_corpus(tmp_path):
    path = tmp_path / "rep.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    cfg = TrainConfig(data=str(path), schedule="none", stages=1, micro_batch_size=16, steps=40,
                      eval_every=10, eval_batches=2, progress=False)
    t = Trainer(cfg)
    before = t.evaluate()  # an untrained byte model: about ln 256
    assert before == pytest.approx(math.log(256), abs=0.3)
    result = launch(cfg)
    held = [s["val_loss"] for s in result["steps"] if s["val_loss"] is not None]
    assert len(held) == 4
    assert held[-1] < held[0] < before
    assert held[-1] < 0.5 * before  # the text repeats: the held-out part is learnable


@pytest.mark.parametrize("kw, message", [
    (dict(eval_every=-1), "--eval-every must be an integer >= 0"),
    (dict(eval_every=2, eval_batches=0), "--eval-batches must be a positive integer"),
    (dict(eval_every=1, eval_batches=10**6), "--eval-batches 1000000 exceeds the limit"),
])
def test_bad_eval_settings_are_refused(kw, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kw)


def test_a_held_out_split_too_short_is_refused_in_one_line(tmp_path, capsys):
    from chimera.cli import main

    path = tmp_path / "short.txt"
    path.write_text("x" * 200)  # 10 held-out bytes; a sequence needs 33
    with pytest.raises(SystemExit) as exc:
        main(["train", "--data", str(path), "--eval-every", "1", "--schedule", "none",
              "--stages", "1", "--no-progress"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "held-out split" in err[0] and "10 tokens" in err[0], err
