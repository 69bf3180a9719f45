"""Watching a run: TensorBoard event files (``--tensorboard DIR``) and model FLOPs utilization.

Every step, each rank times its actions (the executor's per-action record) and sums them per
stage: compute (F, B, I, W) and communication (sends, receives and the gradient allreduce:
SYNC and the wait before STEP, counted on the rank). One all-gather of a few numbers brings
every rank's sums and peak memory to rank 0, which writes the scalars with the
``tensorboard`` package (through ``torch.utils.tensorboard``):

- ``train/loss``, ``train/perplexity``, ``train/lr``, ``train/grad_norm``, ``train/step_s``,
  ``train/tokens``, ``train/tokens_per_s``, ``train/mfu``, ``train/skipped``,
  ``train/loss_scale`` (fp16): the --log-json line's values and what follows from them;
- ``eval/loss``, ``eval/perplexity``, ``eval/seconds`` where ``--eval-every`` evaluated;
- ``stage<s>/compute_s``, ``stage<s>/comm_s``: seconds in the step, over every replica of s;
- ``rank<r>/comm_s`` (everything not compute on rank r), ``rank<r>/peak_rss_mb``,
  ``rank<r>/peak_cuda_mb`` on CUDA.

With ``--grad-accum K`` the action times are those of the step's last pass of the schedule.
Model FLOPs utilization counts the model's FLOPs (3x the forward's: forward, and a backward
of twice its cost; not the recomputation) against ``--peak-flops`` per rank.
"""

from __future__ import annotations

import math

import torch

from chimera.plan.hardware import get_hardware
from chimera.train import faults
from chimera.train.loop import peak_rss_mb
from chimera.train.report import perplexity

# the peak a rank reaches when --peak-flops is not given, by device type (chimera.plan.hardware)
DEFAULT_PEAK = {"cpu": "cpu", "cuda": "h100"}


def peak_flops_per_rank(peak: float | None, device: torch.device) -> float:
    """``--peak-flops``, or the planner's preset for the device: one AVX2 core on a CPU rank
    (1e11), an H100's dense bf16 (989e12) on CUDA."""
    return peak if peak is not None else get_hardware(DEFAULT_PEAK[device.type]).peak_flops


def model_flops_per_token(source) -> float:
    """Training FLOPs per token: forward + backward (twice the forward), no recomputation."""
    return 3.0 * sum(source.layer_flops())


def mfu(tokens: int, seconds: float, flops_per_token: float, ranks: int, peak: float) -> float:
    """Model FLOPs utilization of a step: the model's FLOPs over what the ranks could do."""
    return tokens * flops_per_token / (seconds * ranks * peak) if seconds > 0 else 0.0


def stage_seconds(records, stages: int) -> list[float]:
    """[compute of stage 0.., comm of stage 0.., comm without a stage] from a step's records."""
    out = [0.0] * (2 * stages + 1)
    for r in records:
        spent = r.end - r.start
        if r.action.op.is_compute:
            out[r.action.stage] += spent
        elif r.action.stage >= 0:
            out[stages + r.action.stage] += spent
        else:  # STEP: waiting for the stage allreduces to finish
            out[-1] += spent
    return out


def peak_memory_mb(device: torch.device) -> tuple[float, float]:
    cuda = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else math.nan
    return peak_rss_mb(), cuda


class Watch:
    """One rank's part of ``--tensorboard``: times its steps, rank 0 writes the events."""

    def __init__(self, trainer, logdir: str, rank: int):
        self.trainer, self.rank = trainer, rank
        self.stages, self.ranks = trainer.schedule.stages, trainer.grid.world
        self.flops = model_flops_per_token(trainer.source)
        self.peak = peak_flops_per_rank(trainer.cfg.run.peak_flops, trainer.device)
        self.writer = None
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter  # lazy: only runs that ask load it

            self.writer = SummaryWriter(logdir)

    def after_step(self, log, records) -> None:
        """Gather the step's times and memory (collective) and write them (rank 0)."""
        rows = self._gather(self._mine(log, records or []))
        if self.writer is not None:
            self._write(log, rows)

    def _mine(self, log, records) -> torch.Tensor:
        times = stage_seconds(records, self.stages)
        return torch.tensor([*times, *peak_memory_mb(self.trainer.device)], dtype=torch.float64)

    def _gather(self, mine: torch.Tensor) -> list[torch.Tensor]:
        if self.ranks == 1:
            return [mine]
        context = self.trainer.context
        device, transport = context.collective_device, context.transport
        rows = [torch.empty_like(mine, device=device) for _ in range(self.ranks)]
        faults.collective(transport, "gathering the step's times for --tensorboard",
                          transport.all_gather, rows, mine.to(device))
        return [r.cpu() for r in rows]

    def _write(self, log, rows: list[torch.Tensor]) -> None:
        w, step, s = self.writer, log.step + 1, self.stages  # x axis: optimizer steps done
        scalars = {"train/loss": log.loss, "train/perplexity": perplexity(log.loss),
                   "train/lr": log.lr, "train/grad_norm": log.grad_norm,
                   "train/step_s": log.seconds, "train/tokens": log.tokens,
                   "train/tokens_per_s": log.tokens / log.seconds,
                   "train/mfu": mfu(log.tokens, log.seconds, self.flops, self.ranks, self.peak),
                   "train/skipped": float(log.skipped)}
        if self.trainer.scaler is not None:
            scalars["train/loss_scale"] = self.trainer.scaler.scale
        if log.val_loss is not None:
            scalars.update({"eval/loss": log.val_loss, "eval/perplexity": perplexity(log.val_loss),
                            "eval/seconds": log.eval_seconds})
        total = torch.stack(rows).sum(0)
        for stage in range(s):
            scalars[f"stage{stage}/compute_s"] = float(total[stage])
            scalars[f"stage{stage}/comm_s"] = float(total[s + stage])
        for r, row in enumerate(rows):
            scalars[f"rank{r}/comm_s"] = float(row[s:2 * s + 1].sum())
            scalars[f"rank{r}/peak_rss_mb"] = float(row[-2])
            if not math.isnan(row[-1]):
                scalars[f"rank{r}/peak_cuda_mb"] = float(row[-1])
        for tag, value in scalars.items():
            w.add_scalar(tag, value, step)
        w.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
