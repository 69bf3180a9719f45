"""Check a layout against single-process training: gradients, losses, replica agreement.

``check_equivalence(configs)`` spawns W·D gloo processes once and, for each config (all of
the same world size), compares every replica's gradient after one iteration with the
single-process reference of the same mini-batch, runs a few more AdamW steps, and checks
that the losses match the reference run and that all replicas of a stage are bit-identical.
Used by the test suite; handy for checking a new schedule too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import torch

from chimera.runtime import workers
from chimera.runtime.context import RunContext
from chimera.runtime.transport import OneRank, TorchDist
from chimera.runtime.workers import gloo_group
from chimera.tp import full_tensor
from chimera.train.config import TrainConfig
from chimera.train.loop import Trainer, run_context


def reference_config(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` as one process: one stage, no scheme, the same mini-batch (W*N*B rows) of
    the same data at every step (``chimera judge`` probes a checkpoint with it too)."""
    no_options = dict.fromkeys(TrainConfig.option_fields())
    return dataclasses.replace(cfg, schedule="none", stages=1, data_parallel=1, tensor_parallel=1,
                               options=None,
                               **no_options, micro_batches=1, micro_batch_size=cfg.global_batch,
                               recompute=False, partition=None)


def _whole(trainer: Trainer, of) -> list[tuple[str, int, torch.Tensor]]:
    """(name, pipe, ``of(p)`` whole) per replica parameter ``p`` (``of``: the parameter or
    its gradient): a tensor-parallel shard gathered over its TP group (every TP rank calls
    it, parameters in one order). A frozen parameter has no gradient: left out of those."""
    shards, out = trainer.tp_shards(), []
    for n, pipe, p in trainer.replica_parameters():
        if of(p) is None:
            continue
        value, shard = of(p).detach(), shards.get(id(p))
        out.append((n, pipe, (value if shard is None else
                              full_tensor(value, shard, trainer.pipe.tp)).clone()))
    return out


def _grads(trainer: Trainer) -> list[tuple[str, int, torch.Tensor]]:
    trainer.runtime.gather_gradients()  # a sharded optimizer reduced only its slice
    return _whole(trainer, lambda p: p.grad)


def _one(context: RunContext, cfg: TrainConfig) -> dict | None:
    """One rank of ``cfg`` in ``context``: its gradients and parameters, compared on rank 0."""
    trainer = Trainer(cfg, context)
    box: dict = {}
    logs = [trainer.step(0, on_grads=lambda t: box.setdefault("g", _grads(t)))]
    logs += [trainer.step(s) for s in range(1, cfg.optim.steps)]
    losses = [(log.loss, log.grad_norm) for log in logs]
    mine = {"grads": box["g"], "params": _whole(trainer, lambda p: p)}
    transport = context.transport
    gathered = [None] * transport.get_world_size()
    transport.all_gather_object(gathered, mine)
    if context.rank != 0:
        return None
    return _compare(cfg, gathered, losses, context)


def _compare(cfg: TrainConfig, gathered: list[dict], losses: list[tuple[float, float]],
             context: RunContext) -> dict:
    reference = reference_config(cfg)
    # this process alone, with the run's device and options (not read again)
    ref = Trainer(reference, context.replace(transport=OneRank()))
    box: dict = {}
    ref_logs = [ref.step(0, on_grads=lambda t: box.setdefault("g", _grads(t)))]
    ref_logs += [ref.step(s) for s in range(1, cfg.optim.steps)]
    norms, ref_norms = [n for _, n in losses], [log.grad_norm for log in ref_logs]
    losses, ref_losses = [l for l, _ in losses], [log.loss for log in ref_logs]
    ref_grad = {n: g for n, _, g in box["g"]}
    worst, seen = 0.0, set()
    ref_grad = {n: g.cpu() for n, g in ref_grad.items()}
    params: dict[str, list[torch.Tensor]] = {}
    for rank, got in enumerate(gathered):
        for name, pipe, g in got["grads"]:
            r, g = ref_grad[name], g.cpu()
            err = float((g - r).norm() / max(r.norm(), 1e-30))
            worst = max(worst, err)
            seen.add(name)
        for name, pipe, p in got["params"]:
            params.setdefault(name, []).append(p.cpu())
    identical = all(all(torch.equal(ps[0], q) for q in ps[1:]) for ps in params.values())
    ref_params = {n: p.detach().cpu() for n, _, p in ref.replica_parameters()}
    param_err = max(float((ps[0] - ref_params[n]).norm() / max(ref_params[n].norm(), 1e-30))
                    for n, ps in params.items())
    param_abs = max(float((ps[0] - ref_params[n]).abs().max()) for n, ps in params.items())
    replicas = {n: len(ps) for n, ps in params.items()}
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    norm_err = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(norms, ref_norms))
    return {"config": cfg.to_dict(), "max_grad_rel_err": worst, "missing": sorted(set(ref_grad) - seen),
            "replicas_identical": identical, "min_replicas": min(replicas.values()),
            "max_replicas": max(replicas.values()), "losses": losses, "ref_losses": ref_losses,
            "max_loss_rel_err": loss_err, "max_param_rel_err": param_err,
            "grad_norms": norms, "ref_grad_norms": ref_norms, "max_norm_rel_err": norm_err,
            "max_param_abs_err": param_abs}


def _worker(rank: int, world: int, configs: list[TrainConfig], port: int, out: str) -> None:
    with gloo_group(rank, world, port):
        results = [_one(run_context(cfg, transport=TorchDist()), cfg) for cfg in configs]
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)


def check_equivalence(configs: list[TrainConfig]) -> list[dict]:
    """Run every config (same W·D) in one spawned gloo group; return rank 0's reports."""
    worlds = {c.world for c in configs}
    if len(worlds) != 1:
        raise ValueError(f"configs must share one world size, got {sorted(worlds)}")
    for cfg in configs:
        cfg.preflight()  # before the ranks start
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "equivalence.json")
        world = worlds.pop()
        with workers.hosted_store(world) as store:
            codes = workers.run(_worker, (world, configs, store, out), world, grace=10.0)
        if any(codes):
            raise RuntimeError(f"check_equivalence: ranks exited with codes {codes} (their "
                               "messages are above)")
        with open(out) as f:
            return json.load(f)


def check_virtual(cfg: TrainConfig, device: torch.device | None = None,
                  replay: bool = False) -> dict:
    """The same report with every rank a thread of this process (``chimera.runtime.virtual``):
    no process group, so it runs where only one device exists (all ranks on one GPU).
    ``replay``: every rank's ``dist`` calls are recorded and replayed under NCCL's strictest
    model (:func:`chimera.check.rendezvous.replay_recorded`, raising if they would hang or
    mismatch); the report then says how many calls were replayed."""
    from chimera.check.rendezvous import replay_recorded
    from chimera.runtime.virtual import VirtualWorld, run_virtual

    cfg.preflight()
    world = VirtualWorld(cfg.world, record=replay)
    def rank_of(rank: int) -> dict | None:  # virtual rank ``rank``'s transport, handed down
        return _one(run_context(cfg, device, world.rank(rank)), cfg)
    report = run_virtual(cfg.world, rank_of, world)[0]
    if replay:
        report["replayed_calls"] = replay_recorded(world.recorded(), "strict")
    return report
