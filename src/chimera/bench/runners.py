"""Our rows' runners (torch's: ``bench.torchpp``), one per row and rank, each with ``step(i)``:
a full optimizer step.

Every row trains the same model on the same mini-batch ``get_batch(step i)``: forward,
backward, gradient sync, global-norm clipping and an AdamW step (the same optimizer settings
everywhere), so their step times compare like with like.
"""

from __future__ import annotations

import torch

from chimera.bench.rows import BenchConfig, Row
from chimera.train import build
from chimera.train.config import TrainConfig
from chimera.models import loss_fn
from chimera.runtime.clip import clip_by_global_norm_, sum_of_squares
from chimera.runtime.context import RunContext
from chimera.train.loop import Trainer, lr_at, run_context


class SingleRunner:
    """One process (rank 0; other ranks sit it out): the whole mini-batch at once, or, with the
    row option ``micro_batches``, accumulated over the pipelines' micro-batches. Its trainer
    runs alone (a world of one, ``run_context``), whatever group the rank is in."""

    def __init__(self, cfg: BenchConfig, row: Row, context: RunContext):
        self.rank, self.threads, self.base = context.rank, row.threads or 1, cfg.threads
        self.micro = cfg.micro_batch_size if row.opts.get("micro_batches") else None
        self.trainer = None
        if self.rank == 0:
            tc = TrainConfig(model=cfg.model, schedule="none", stages=1, micro_batches=1,
                             micro_batch_size=cfg.global_batch, steps=cfg.rounds + 2,
                             seed=cfg.seed, progress=False).preflight()
            self.trainer = Trainer(tc, run_context(tc, context.device))

    def step(self, i: int) -> float | None:
        if self.trainer is None:
            return None
        torch.set_num_threads(self.threads)
        try:
            return self.trainer.step(i).loss if self.micro is None else self._accumulated(i)
        finally:
            torch.set_num_threads(self.base)

    def _accumulated(self, i: int) -> float:
        """Gradient accumulation over micro-batches, then the same clipping and AdamW step."""
        tr = self.trainer
        inputs, targets = tr.batch(i)
        tr.optimizer.zero_grad(set_to_none=False)
        lossf, total = loss_fn(build.model_config(tr.cfg), "mean"), 0.0
        for x, y in zip(inputs.split(self.micro), targets.split(self.micro)):
            loss = lossf(tr.model(x), y) * (len(x) / len(inputs))
            loss.backward()
            total += float(loss.detach())
        grads = [p.grad for p in tr.params]
        clip_by_global_norm_(grads, sum_of_squares(grads), tr.cfg.optim.clip or None)
        for group in tr.optimizer.param_groups:
            group["lr"] = lr_at(tr.cfg, i)
        tr.optimizer.step()
        return total


class OursRunner:
    """Our runtime (``chimera.train.Trainer``) with one of our schedules, on the ranks of
    ``context``."""

    def __init__(self, cfg: BenchConfig, row: Row, context: RunContext):
        opts = row.opts
        tc = TrainConfig(model=cfg.model, schedule=row.schedule, stages=cfg.stages,
                         micro_batches=cfg.micro_batches, micro_batch_size=cfg.micro_batch_size,
                         steps=cfg.rounds + 2, seed=cfg.seed,
                         options=row.scheme_options,
                         shard_optimizer=bool(opts.get("shard")),
                         threads=cfg.threads, comm_timeout=cfg.comm_timeout,
                         progress=False).preflight()
        self.trainer = Trainer(tc, run_context(tc, context.device, context.transport))

    def step(self, i: int) -> float:
        return self.trainer.step(i).loss


class ActivationMeter:
    """Peak bytes of tensors saved for backward (activations), parameters excluded.

    A saved-tensor hook wraps each saved tensor in a holder whose finalizer runs when autograd
    frees it; storages shared by several saved tensors count once. The same measure applies
    to every row, whoever wrote the schedule.
    """

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.params or t.device.type == "meta":
            return t
        if self.refs.get(key, 0) == 0:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        return _Held(self, key, storage.nbytes(), t)

    def release(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= nbytes


class _Held:
    __slots__ = ("meter", "key", "nbytes", "tensor")

    def __init__(self, meter: ActivationMeter, key: int, nbytes: int, tensor: torch.Tensor):
        self.meter, self.key, self.nbytes, self.tensor = meter, key, nbytes, tensor

    def __del__(self):
        self.meter.release(self.key, self.nbytes)


def _unpack(x):
    return x.tensor if isinstance(x, _Held) else x


def runner_params(runner) -> list:
    if isinstance(runner, (SingleRunner, OursRunner)):
        return [] if runner.trainer is None else list(runner.trainer.params)
    return list(runner.params)


def peak_activation_bytes(runner, i: int) -> int:
    """One step of ``runner`` under an :class:`ActivationMeter`; returns its peak bytes."""
    meter = ActivationMeter(runner_params(runner))
    with meter.hooks():
        runner.step(i)
    return meter.peak

