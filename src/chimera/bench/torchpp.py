"""A benchmark row on ``torch.distributed.pipelining``: the same stage modules, cut and data.

The model is cut exactly as our runtime cuts it for the same number of stages
(``chimera.train.loop.stage_ranges``), every stage is built from the same seeded layers, the
loss is the same mean cross entropy per micro-batch (torch scales gradients by 1/N, which
makes it the mini-batch mean, as ours), and the step ends with the same global-norm clipping
and AdamW step.
"""

from __future__ import annotations

import torch
from torch.distributed import pipelining

from chimera.bench.rows import TORCH_SCHEDULES, BenchConfig, Row
from chimera.data import get_batch, load_corpus
from chimera.models import build_layers, get_config, loss_fn
from chimera.runtime.clip import clip_by_global_norm_, sum_of_squares
from chimera.runtime.context import RunContext
from chimera.runtime.transport import Transport
from chimera.train import build
from chimera.train.config import TrainConfig
from chimera.train.loop import make_optimizer, stage_ranges


def stages_of(style: str, rank: int, ranks: int, per_rank: int) -> list[int]:
    """The stage indices ``rank`` holds under torch's placement ``style``."""
    if style == "linear":
        return [rank]
    if style == "loop":
        return [rank + k * ranks for k in range(per_rank)]
    return [rank, 2 * ranks - 1 - rank]  # "v"


def run_schedule(transport: Transport, schedule, first: bool, last: bool, inputs, targets,
                 micro_batches: int, copies: int = 1, finish=None) -> float:
    """One ``schedule.step`` of torch's pipelining (inputs where this rank holds the first
    stage, targets where it holds the last), then ``finish()`` (the data-parallel reduction's
    wait, if any); the mini-batch's mean loss over the ``copies`` pipelines on every rank of
    ``transport``."""
    losses: list = []
    schedule.step(*((inputs,) if first else ()), target=targets if last else None,
                  losses=losses if last else None, return_outputs=False)
    if finish is not None:
        finish()
    total = torch.tensor([sum(float(l.detach()) for l in losses) / (micro_batches * copies)],
                         dtype=torch.float64)
    transport.all_reduce(total)
    return float(total.item())


class TorchPipeline:
    """This rank's share of a torch.distributed.pipelining schedule ``row.schedule`` over
    ``cfg.stages`` ranks (``context``'s: torch's pipelining talks to ``torch.distributed``
    itself, our losses and norms go through the context's transport): ``module_of(stage, n)``
    builds stage ``stage`` of ``n`` (the same weights on every rank); ``step`` runs one
    mini-batch. ``group``: the pipeline's ranks (one of ``cfg.data_parallel`` copies; None:
    the whole world); ``self.reduction`` (set by a subclass): the data-parallel reduction
    waited for at the end of the step."""

    def __init__(self, cfg: BenchConfig, row: Row, context: RunContext, module_of, loss,
                 group=None):
        cls_name, self.style, per_rank = TORCH_SCHEDULES[row.schedule]
        cls = getattr(pipelining, cls_name, None)
        if cls is None:
            raise RuntimeError(f"torch {torch.__version__} has no pipelining.{cls_name}")
        self.cfg, self.row, self.transport = cfg, row, context.transport
        self.stages = n = cfg.stages * per_rank
        self.indices = stages_of(self.style, context.rank % cfg.stages, cfg.stages, per_rank)
        self.modules = [module_of(i, n) for i in self.indices]
        self.stage_objects = [pipelining.PipelineStage(m, i, n, torch.device("cpu"), group=group)
                              for m, i in zip(self.modules, self.indices)]
        stages = self.stage_objects
        self.schedule = cls(stages[0] if per_rank == 1 else stages,
                            n_microbatches=cfg.micro_batches, loss_fn=loss)
        self.first, self.last = 0 in self.indices, n - 1 in self.indices
        self.params = [p for m in self.modules for p in m.parameters()]
        self.reduction = None

    def run(self, inputs, targets) -> float:
        return run_schedule(self.transport, self.schedule, self.first, self.last, inputs,
                            targets, self.cfg.micro_batches, self.cfg.data_parallel,
                            self.reduction and self.reduction.wait)


class TorchRunner(TorchPipeline):
    def __init__(self, cfg: BenchConfig, row: Row, context: RunContext):
        self.model = get_config(cfg.model)
        self.tc = TrainConfig(model=cfg.model, schedule="none", stages=1, micro_batches=1,
                              micro_batch_size=cfg.global_batch, steps=cfg.rounds + 2,
                              seed=cfg.seed, progress=False).preflight()
        cut: dict[int, list[range]] = {}

        def module_of(stage: int, n: int) -> torch.nn.Module:
            ranges = cut.setdefault(n, stage_ranges(self.tc, build.model_source(self.tc), n))
            return torch.nn.Sequential(*build_layers(self.model, cfg.seed, ranges[stage]))
        super().__init__(cfg, row, context, module_of, loss_fn(self.model, "mean"))
        self.optimizer = make_optimizer(self.params, self.tc)
        self.corpus = load_corpus(None, seq_len=self.model.seq_len)

    def step(self, i: int) -> float:
        inputs, targets = get_batch(self.corpus, i, self.cfg.global_batch, self.model.seq_len,
                                    self.cfg.seed, self.model.kind)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.run(inputs, targets)
        self._clip()
        self.optimizer.step()
        return loss

    def _clip(self) -> float:
        grads = [p.grad for p in self.params if p.grad is not None]
        return float(clip_by_global_norm_(grads, sum_of_squares(grads), self.tc.optim.clip or None,
                                          all_reduce=self.transport.all_reduce))
