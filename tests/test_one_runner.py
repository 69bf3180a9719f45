"""One runner (issue 24): ``chimera train``'s Trainer drives the library's ``api.Pipeline``, and
the single-process reference is a one-stage run of the same code.

- the Trainer's step is the Pipeline's: a Pipeline built with the public API from the same
  layers, stepped by hand with the same optimizer on the trainer's batches, ends with the
  same parameters, bit for bit (gradient accumulation and a sharded optimizer included);
- the reference (``--schedule none``) is a one-stage 1f1b Pipeline on a world of one rank;
- accumulation, clipping and the tie refusal go through the one place (Pipeline, byo).
"""

import functools
import inspect

import pytest
import torch
from torch import nn

from chimera.api import ExecOptions, ModelOptions, Pipeline
from chimera.byo import refuse_sharded_ties
from chimera.errors import UserError
from chimera.runtime.virtual import run_virtual
from chimera.train import loop
from chimera.train.config import TrainConfig
from chimera.train.loop import Trainer, lr_at, make_optimizer

STEPS = 3


def _by_hand(cfg: TrainConfig, trainer: Trainer) -> dict:
    """The trainer's run written with the public API: Pipeline.step per mini-batch, clipping,
    AdamW with the trainer's learning rate; its parameters by model-wide name."""
    source = trainer.source
    pipe = Pipeline(functools.partial(loop._layer, source, cfg.optim.seed, torch.float64),
                    source.loss_fn, cfg.pipeline.schedule, stages=cfg.pipeline.stages,
                    micro_batches=cfg.n_micro, micro_batch_size=cfg.pipeline.micro_batch_size,
                    data_parallel=cfg.pipeline.data_parallel,
                    model=ModelOptions(partition=trainer.pipe.ranges, seed=cfg.optim.seed, num_layers=source.num_layers),
                    options=ExecOptions(shard_optimizer=cfg.pipeline.shard_optimizer, schedule_options=cfg.pipeline.scheme_options))
    opt = make_optimizer(pipe.parameters(), cfg, [m for _, m in pipe.runtime.optimizer_parameters()])
    for step in range(STEPS):
        inputs, targets = trainer.batch(step)
        rows = cfg.global_batch
        for k in range(cfg.optim.grad_accum):
            pipe.step(inputs[k * rows:(k + 1) * rows], targets[k * rows:(k + 1) * rows],
                      accumulate=k > 0, loss_scale=1.0 / cfg.optim.grad_accum)
        pipe.clip_grad_norm_(cfg.optim.clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        opt.step()
    return {source.key(n): p.detach().clone() for n, p in pipe.named_parameters()}


@pytest.mark.parametrize("schedule,accum,shard", [("chimera", 1, False), ("1f1b", 2, False),
                                                   ("chimera", 2, True)])
def test_the_trainers_step_is_the_pipelines(schedule, accum, shard):
    cfg = TrainConfig(schedule=schedule, stages=2, micro_batches=4, micro_batch_size=2,
                      dtype="float64", steps=STEPS, grad_accum=accum, shard_optimizer=shard,
                      clip=0.05, progress=False)  # a small clip: it clips on every step

    def body(rank):
        trainer = Trainer(cfg)
        norms = [trainer.step(s).grad_norm for s in range(STEPS)]
        mine = {n: p.detach().clone() for n, _, p in trainer.replica_parameters()}
        return mine, _by_hand(cfg, trainer), norms

    for mine, theirs, norms in run_virtual(cfg.world, body):
        assert all(n > cfg.optim.clip for n in norms)
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), name


def test_the_reference_is_a_one_stage_pipeline_on_one_rank():
    cfg = TrainConfig(schedule="none", stages=1, micro_batches=2, micro_batch_size=4,
                      dtype="float64", steps=STEPS, progress=False)
    ref = Trainer(cfg)
    assert isinstance(ref.pipe, Pipeline)
    assert (ref.schedule.name, ref.schedule.stages, ref.grid.world) == ("1f1b", 1, 1)
    assert ref.schedule.micro_batches == 1 and ref.pipe.rows == cfg.global_batch  # one device
    losses = [ref.step(s).loss for s in range(STEPS)]

    # the same one-stage run, by hand on a virtual world of one rank
    one = TrainConfig(schedule="1f1b", stages=1, micro_batches=1, micro_batch_size=8,
                      dtype="float64", steps=STEPS, progress=False)
    [(theirs, their_losses)] = run_virtual(1, lambda rank: _one_stage(one))
    assert losses == their_losses
    for name, _, p in ref.replica_parameters():
        assert torch.equal(p, theirs[name]), name
    # and no branch on the mode: the trainer's code never asks
    assert "reference" not in inspect.getsource(Trainer).replace("single-process reference", "")


def _one_stage(cfg: TrainConfig):
    trainer = Trainer(cfg)
    losses = [trainer.step(s).loss for s in range(STEPS)]
    return {n: p.detach().clone() for n, _, p in trainer.replica_parameters()}, losses


def test_accumulation_and_clipping_go_through_the_pipeline(monkeypatch):
    calls = []
    step, clip = Pipeline.step, Pipeline.clip_grad_norm_
    monkeypatch.setattr(Pipeline, "step", lambda self, *a, **k: calls.append("step") or
                        step(self, *a, **k))
    monkeypatch.setattr(Pipeline, "clip_grad_norm_", lambda self, *a, **k: calls.append("clip") or
                        clip(self, *a, **k))
    cfg = TrainConfig(schedule="none", stages=1, micro_batch_size=4, dtype="float64", steps=2,
                      grad_accum=3, progress=False)
    trainer = Trainer(cfg)
    trainer.step(0)
    assert calls == ["step", "step", "step", "clip"]


def test_one_refusal_of_sharded_ties():
    with pytest.raises(UserError) as expected:
        refuse_sharded_ties(["0.weight"])

    def body(rank):
        emb = nn.Embedding(8, 4)
        head = nn.Linear(4, 8, bias=False)
        head.weight = emb.weight  # tied across the two stages
        with pytest.raises(UserError) as got:
            Pipeline([emb, head], nn.functional.cross_entropy, "1f1b", stages=2, micro_batches=2,
                     options=ExecOptions(shard_optimizer=True))
        return str(got.value)

    assert run_virtual(2, body) == [str(expected.value)] * 2
    refuse_sharded_ties([])  # nothing tied: nothing refused


def test_a_sharded_accumulation_gathers_the_parameters_once_per_update():
    """The trainer prefetches the parameters after each optimizer step; the mini-batches it
    accumulates into the next update do not gather them again."""
    cfg = TrainConfig(schedule="chimera", stages=2, micro_batches=2, micro_batch_size=2,
                      dtype="float64", steps=2, grad_accum=3, shard_optimizer=True, progress=False)

    def body(rank):
        trainer = Trainer(cfg)
        trainer.step(0)
        calls, gather = [], trainer.runtime.gather_parameters
        trainer.runtime.gather_parameters = lambda: calls.append(1) or gather()
        trainer.step(1)
        return len(calls), len(trainer.runtime.shards)

    assert run_virtual(cfg.world, body) == [(1, 2), (1, 2)]  # (sharded: both replicas)
