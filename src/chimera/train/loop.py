"""The training loop of one rank: data, optimizer, precision, logging, measured timeline,
around the library's :class:`chimera.api.Pipeline`, which runs each step."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import resource
import time
from dataclasses import dataclass

import torch

from chimera.api import ExecOptions, LoRAOptions, LossOptions, ModelOptions, Pipeline, micro_count
from chimera.check.validate import validate
from chimera.data import VAL_FRACTION, Corpus, get_batch, split_corpus
from chimera.data.formats import open_data
from chimera.errors import UserError
from chimera.ir import Schedule
from chimera.models import parse_partition, partition
from chimera.passes import lower
from chimera.runtime.executor import ActionRecord, MicroData
from chimera.runtime.grid import ProcessGrid
from chimera.runtime.p2p import CommTimeout
from chimera.runtime.pipeline import PipelineRuntime
from chimera.runtime.shared import TieSync
from chimera.runtime.context import RunContext, RuntimeOptions
from chimera.runtime.transport import OneRank, Transport
from chimera.schedules import build
from chimera.tp import shard_of
from chimera.train import faults
from chimera.train.build import data_spec, model_source
from chimera.train.config import WIRE_DTYPES, TrainConfig
from chimera.train.optim import lr_at, make_optimizer  # noqa: F401 (lr_at: the loop's schedule)
from chimera.train.precision import LossScaler, MasterWeights

# --dtype -> (the parameters' dtype, the autocast dtype or None)
DTYPE = {"float32": torch.float32, "float64": torch.float64, "bf16": torch.float32,
         "bf16-master": torch.bfloat16, "fp16": torch.float32}
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepLog:
    step: int
    loss: float
    lr: float
    grad_norm: float
    seconds: float
    tokens: int
    skipped: bool = False  # non-finite loss or gradient norm with --skip-nonfinite: no step taken
    val_loss: float | None = None  # held-out loss after this step, where --eval-every asked for it
    eval_seconds: float | None = None  # what computing it took (not in ``seconds``)


class NonFiniteLoss(RuntimeError):
    """The loss or the gradient norm of a step is NaN or infinite (every rank agrees)."""

    def __init__(self, message: str, loss: float | None = None, grad_norm: float | None = None):
        super().__init__(message)
        self.loss, self.grad_norm = loss, grad_norm


def stage_ranges(cfg: TrainConfig, source, n_stages: int) -> list[range]:
    if cfg.net.partition:
        ranges = parse_partition(cfg.net.partition, source.num_layers)
        if len(ranges) != n_stages:
            raise UserError(f"--partition gives {len(ranges)} stages, the schedule needs {n_stages}")
        return ranges
    return partition(source.layer_costs(), n_stages)


def check_heldout(corpus: torch.Tensor, kind: str, seq_len: int) -> None:
    """--eval-every needs at least one sequence in the held-out split (ValueError)."""
    held = len(split_corpus(corpus, "val"))
    need = seq_len + 1 if kind == "gpt2" else seq_len
    if held < need:
        raise UserError(f"--eval-every: the held-out split (--val-data, else --val-fraction of "
                         f"the documents, {VAL_FRACTION:.0%} by default) has {held} tokens, fewer "
                         f"than one sequence of {need}; hold out more or drop --eval-every")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def layout(cfg: TrainConfig) -> Schedule:
    """The lowered schedule a config runs: its own, or for the single-process reference
    (``--schedule none``) one stage of 1f1b that takes the whole mini-batch as one
    micro-batch, the computation of one device."""
    if not cfg.reference:
        return cfg.build_schedule()
    return validate(lower(build("1f1b", 1, 1), cfg.pipeline.sync))


def runtime_options(cfg: TrainConfig, environ=None) -> RuntimeOptions:
    """The runtime's switches of a run: its config's, each unset one from its ``CHIMERA_*``
    variable (:meth:`RuntimeOptions.from_env`)."""
    run = cfg.run
    return RuntimeOptions.from_env(environ, comm_timeout=run.comm_timeout,
                                   device_plan=run.device_plan, emulate_nccl=run.emulate_nccl,
                                   malloc=run.malloc, fault=run.fault)


def run_context(cfg: TrainConfig, device: torch.device | None = None,
                transport: Transport | None = None) -> RunContext:
    """The context a rank of ``cfg`` runs in: the single-process reference in this process
    with nobody (:class:`OneRank`, no process group), else ``transport`` (default the one in
    effect: ``torch.distributed``, or a virtual rank's); ``device`` (default the CPU)."""
    if transport is None and cfg.world == 1:
        transport = OneRank()
    return RunContext.here(transport, device or torch.device("cpu"), runtime_options(cfg))


def _layer(source, seed: int, dtype: torch.dtype, index: int) -> torch.nn.Module:
    return source.build_layer(index, seed).to(dtype)


class Trainer:
    """One rank of a run: the config's data, optimizer, precision and schedule of steps
    around an :class:`chimera.api.Pipeline` (``self.pipe``), which owns the step itself
    (slicing, loss weights, gradient and tie sync, clipping, the sharded gather). The
    single-process reference is a one-stage pipeline on a world of one rank (:func:`layout`).
    """

    def __init__(self, cfg: TrainConfig, context: RunContext | None = None,
                 corpus: Corpus | None = None):
        """``context``: the rank's transport, device and runtime options (default
        :func:`run_context`); ``corpus``: cfg's data as the launcher opened it (``launch``),
        else read here."""
        self.cfg = cfg
        self.context = context if context is not None else run_context(cfg)
        self.rank, self.device = self.context.rank, self.context.device
        self.source = model_source(cfg)  # the model, its vocabulary the data's (train/sources.py)
        # rank 0 reads every id of a token file through (the others trust its check: one
        # scan of a 2 GiB file took 2.2 s, once per rank before)
        self.corpus = corpus if corpus is not None else open_data(
            data_spec(cfg), seq_len=self.source.seq_len, scan=self.rank == 0)
        if cfg.run.eval_every:
            check_heldout(self.corpus, self.source.kind, self.source.seq_len)
        self.dtype = DTYPE[cfg.net.dtype]
        self.autocast = AUTOCAST.get(cfg.net.dtype)
        self.scaler = LossScaler() if cfg.net.dtype == "fp16" else None
        self.master: MasterWeights | None = None  # bf16-master: the optimizer's float32 copies
        self.last_records: list[ActionRecord] = []  # the last step's action times, when recorded
        self._build()

    # -- construction -----------------------------------------------------------------
    def _build(self) -> None:
        cfg, source = self.cfg, self.source
        schedule = layout(cfg)
        n = micro_count(schedule)
        # every rank makes the same batches (get_batch) and the sources hold no running
        # statistics: no batch check and no buffer sync (collectives a step need not make)
        wire = cfg.net.wire_dtype
        self.pipe = Pipeline(
            functools.partial(_layer, source, cfg.optim.seed, self.dtype), source.loss_fn, schedule,
            micro_batches=n, micro_batch_size=cfg.global_batch // (cfg.pipeline.data_parallel * n),
            data_parallel=cfg.pipeline.data_parallel, tensor_parallel=cfg.pipeline.tensor_parallel,
            model=ModelOptions(num_layers=source.num_layers, seed=cfg.optim.seed, ties=source.ties,
                               partition=stage_ranges(cfg, source, schedule.stages),
                               compile=cfg.run.compile,
                               tp_plan=source.tp_plan() if cfg.pipeline.tensor_parallel > 1 else None,
                               freeze=cfg.net.freeze,
                               lora=LoRAOptions(**cfg.net.lora) if cfg.net.lora else None),
            loss=LossOptions("token_mean" if source.sums else "mean",
                             token_count=source.token_count),
            options=ExecOptions(recompute=cfg.pipeline.recompute, autocast=self.autocast,
                                wire_dtype=getattr(torch, WIRE_DTYPES[wire]) if wire else None,
                                shard_optimizer=cfg.pipeline.shard_optimizer,
                                sync_buffers=False, check_batch=False),
            example_input=source.inputs(torch.zeros((1, source.seq_len), dtype=torch.long)),
            context=self.context)
        # unchanged unless a drill
        self.runtime.program = faults.program_for(self.runtime.program, schedule, self.rank,
                                                  self.context.options.fault)
        tensors = self.runtime.optimizer_parameters()
        self._make_optimizer([t for t, _ in tensors], [m for _, m in tensors])

    def _make_optimizer(self, params: list[torch.Tensor], matrix: list[bool]) -> None:
        """``self.params``, what the optimizer updates and clipping scales: the parameters, or
        with bf16-master their float32 masters."""
        if self.cfg.net.dtype == "bf16-master":
            self.master = MasterWeights(params)
            params = self.master.masters
        self.params = params
        self.optimizer = make_optimizer(params, self.cfg, matrix)

    @property
    def runtime(self) -> PipelineRuntime:
        return self.pipe.runtime

    @property
    def schedule(self) -> Schedule:
        return self.pipe.schedule

    @property
    def grid(self) -> ProcessGrid:
        return self.pipe.grid

    @property
    def tie_sync(self) -> TieSync:
        return self.pipe.tie_sync

    @property
    def model(self) -> torch.nn.Module:
        """The whole model, where one stage holds it (the single-process reference)."""
        if len(self.runtime.modules) != 1:
            raise AttributeError("model: the stages of this run are on several ranks")
        return next(iter(self.runtime.modules.values()))

    # -- one step -------------------------------------------------------------------------
    def batch(self, step: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Training: the ``step_batch`` rows of optimizer step ``step``; held-out: a mini-batch."""
        rows = self.cfg.step_batch if split == "train" else self.cfg.global_batch
        return get_batch(self.corpus, step, rows, self.source.seq_len,
                         self.cfg.optim.seed, self.source.kind, split=split,
                         vocab_size=self.source.vocab_size)

    def step(self, step: int, record: list[ActionRecord] | None = None, on_grads=None) -> StepLog:
        """Forward, backward and gradient sync of ``grad_accum`` mini-batches, clipping and
        the optimizer step of ``step``.

        ``on_grads(trainer)``, if given, sees the synchronized gradients before clipping.
        """
        start = time.perf_counter()
        inputs, targets = self.batch(step)
        if record is None and self.cfg.run.tensorboard:  # --tensorboard times every step
            record = []
        self.last_records = record if record is not None else []
        try:
            loss = self._backward(inputs, targets, record)
            if self.master is not None:
                self.master.grads_to_masters()
            if on_grads is not None:
                on_grads(self)
            norm = float(self.pipe.clip_grad_norm_(self.cfg.optim.clip or None, parameters=self.params))
        except CommTimeout as exc:  # a hang or a dead peer: say where every rank was
            raise faults.explain(exc, self.schedule, self.grid, self.context.transport) from exc
        lr = lr_at(self.cfg, step)
        skipped = not (math.isfinite(loss) and math.isfinite(norm))
        overflow = skipped and self.scaler is not None and math.isfinite(loss)
        if self.scaler is not None:  # float16 overflowed: a smaller scale, not an error
            self.scaler.update(overflow)
        if skipped and not (self.cfg.run.skip_nonfinite or overflow):
            raise NonFiniteLoss(f"step {step}: the loss ({loss}) or the gradient norm ({norm}) is not "
                                "finite; stopped before the optimizer step (lower --lr, check the "
                                "data, or pass --skip-nonfinite to skip such steps)", loss, norm)
        if not skipped:  # loss and norm are all-reduced: every rank takes the same branch
            self._optimizer_step(lr)
        return StepLog(step, loss, lr, norm, time.perf_counter() - start, inputs.numel(), skipped)

    def _optimizer_step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self.master is not None:
            self.master.masters_to_params()
        self.pipe.prefetch_parameters()  # sharded: every replica gets every slice

    def _minibatches(self, inputs, targets) -> tuple[list, dict]:
        """A batch of whole mini-batches (``global_batch`` rows each) as a list of them, and
        the loss weights that make the sum of their losses the batch's mean (over its rows,
        or over all its target tokens for a summed loss). Each mini-batch's inputs are what the
        first layer takes (``ModelSource.inputs``: with --doc-mask, its documents kept apart)."""
        rows = self.cfg.global_batch
        parts = [(self.source.inputs(inputs[i:i + rows]), targets[i:i + rows])
                 for i in range(0, inputs.shape[0], rows)]
        if self.source.sums:
            return parts, {"total_tokens": self.source.token_count(targets), "loss_scale": 1.0}
        return parts, {"loss_scale": 1.0 / len(parts)}

    def _backward(self, inputs, targets, record) -> float:
        """The step's loss (unscaled); the summed gradients of its ``grad_accum`` mini-batches
        left in the parameters' .grad, divided by the loss scale where there is one."""
        scale = self.scaler.scale if self.scaler is not None else 1.0
        parts, weights = self._minibatches(inputs, targets)
        weights["loss_scale"] *= scale  # the micro-batches' loss weights carry the scale
        total = 0.0
        for i, (x, t) in enumerate(parts):
            last = i == len(parts) - 1
            total += self.pipe.step(x, t, accumulate=i > 0, record=record if last else None,
                                    **weights)
        if self.scaler is not None:
            self.scaler.unscale_(self.runtime.grad_tensors())
        return total / scale

    def _micro_data(self, inputs, targets) -> MicroData:
        """This rank's micro-batches of one mini-batch, for running the runtime directly."""
        return self.pipe._micro_data(self.source.inputs(inputs), targets, 1.0)[0]

    # -- held-out loss ------------------------------------------------------------------
    def evaluate(self) -> float:
        """The loss on the first ``eval_batches`` mini-batches of the held-out split (the same
        ones at every evaluation, so evaluations compare): the mean over their target tokens.

        Forwards only (the schedule's forward-only program and its own comm plan:
        ``chimera.api.Pipeline.eval_step``), in eval mode (dropout off), without autograd;
        gradients, optimizer state, RNG and train mode are as they were. Collective: every
        rank calls it.
        """
        batches = [self.batch(i, "val") for i in range(self.cfg.run.eval_batches)]
        inputs, targets = (torch.cat(t) for t in zip(*batches))
        return self._forward_loss(inputs, targets, self.runtime.eval_schedule)

    def probe_loss(self, step: int) -> float:
        """The loss of the current weights on training mini-batch ``step``, forwards only (as
        :meth:`evaluate`: eval mode, no autograd, training unchanged): how the final
        checkpoint of a run, which no step follows, is judged. Collective."""
        return self._forward_loss(*self.batch(step), self.runtime.eval_schedule)

    def _forward_loss(self, inputs, targets, schedule: Schedule) -> float:
        parts, weights = self._minibatches(inputs, targets)
        with self._eval_mode():
            try:
                return sum(self.pipe.eval_step(x, t, **weights) for x, t in parts)
            except CommTimeout as exc:
                raise faults.explain(exc, schedule, self.grid, self.context.transport) from exc

    @contextlib.contextmanager
    def _eval_mode(self):
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), \
                torch.no_grad():
            self.pipe.eval()
            try:
                yield
            finally:
                self.pipe.train()

    def equalize_ties(self) -> None:
        """Every copy of a tied weight takes its first stage's value (after a load); with
        bf16-master, every parameter first takes its master's (what was loaded)."""
        if self.master is not None:
            self.master.masters_to_params()
        self.tie_sync.equalize()

    def run_state(self) -> dict:
        """What a checkpoint's ``meta.json`` keeps of the run beyond tensors: fp16's loss scale."""
        if self.scaler is None:
            return {}
        return {"loss_scale": self.scaler.scale, "loss_scale_good_steps": self.scaler.good_steps}

    def load_run_state(self, run: dict) -> None:
        """The loss scale a checkpoint kept (every rank reads the same ``meta.json``)."""
        if self.scaler is not None and "loss_scale" in run:
            self.scaler.scale = float(run["loss_scale"])
            self.scaler.good_steps = int(run.get("loss_scale_good_steps", 0))

    def whole_optimizer_state(self, empty: bool = False) -> dict:
        """Where the optimizer is sharded: each parameter's whole AdamW state, gathered over
        its replica group (collective, stages in order), or zeros to load into (``empty``).
        {} where it is not: the optimizer's own state is whole."""
        shards = self.runtime.shards
        out: dict = {}
        for key in sorted(shards, key=lambda k: (k[1], k[0])):
            if not empty:
                out.update(shards[key].gather_state(self.optimizer))
                continue
            for p in shards[key].params:
                fused = self.optimizer.defaults.get("fused")
                out[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p),
                          "step": torch.zeros((), device=p.device if fused else "cpu")}
        return out

    def load_whole_optimizer_state(self, whole: dict) -> None:
        """Each slice of a sharded optimizer takes its part of ``whole``."""
        for shard in self.runtime.shards.values():
            shard.scatter_state(self.optimizer, whole)

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (AdamW: two moments per element it updates)."""
        return sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                   for t in st.values() if isinstance(t, torch.Tensor))

    def _saved(self, p: torch.Tensor) -> torch.Tensor:
        """What a checkpoint holds for parameter ``p``: itself, or with bf16-master its master
        (the float32 weights the optimizer state belongs to)."""
        return p if self.master is None else self.master.master_of().get(id(p), p)  # frozen: itself

    def replica_parameters(self) -> list[tuple[str, int, torch.Tensor]]:
        """(model-wide name, pipe, parameter) for every replica this rank holds (masters,
        with bf16-master)."""
        self.runtime.finish_gather()  # sharded: the last step's all-gathers are complete
        return [(self.source.key(n), pipe, self._saved(p))
                for (pipe, stage), module in sorted(self.runtime.modules.items())
                for n, p in module.named_parameters()]

    def tp_shards(self) -> dict[int, object]:
        """id of each tensor a checkpoint saves for a sharded parameter (the parameter, or its
        master) -> its ``chimera.tp.Shard``; {} without tensor parallelism."""
        if self.pipe.tp is None:
            return {}
        return {id(self._saved(p)): shard_of(p) for module in self.runtime.modules.values()
                for p in module.parameters() if shard_of(p) is not None}

    def checkpoint_parameters(self) -> dict[str, torch.Tensor]:
        """Model-wide name -> parameter of the replicas this rank writes to a checkpoint:
        pipe 0's in data replica 0, so each stage once, spread over the D ranks; a tie once,
        from its first stage."""
        self.runtime.finish_gather()
        if self.grid.w != 0:
            return {}
        elsewhere = self.tie_sync.counted_elsewhere()
        return {self.source.key(n): self._saved(p)
                for (pipe, stage), module in sorted(self.runtime.modules.items())
                if pipe == 0 for n, p in module.named_parameters() if id(p) not in elsewhere}


def log_line(log: StepLog) -> str:
    line = {"step": log.step, "loss": log.loss, "lr": log.lr, "grad_norm": log.grad_norm,
            "step_s": log.seconds, "tokens": log.tokens}
    if log.skipped:
        line["skipped"] = True
    if log.val_loss is not None:
        line.update(val_loss=log.val_loss, eval_s=log.eval_seconds)
    return json.dumps(line)
