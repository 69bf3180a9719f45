"""The training loop of one rank: data, optimizer, clipping, logging, measured timeline."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import resource
import time
from dataclasses import dataclass, field

import torch

from chimera.data import VAL_FRACTION, Corpus, get_batch, split_corpus
from chimera.data.formats import open_data
from chimera.errors import UserError
from chimera.models import parse_partition, partition
from chimera.runtime.clip import clip_by_global_norm_, sum_of_squares
from chimera.runtime.executor import ActionRecord, MicroData, to_device
from chimera.runtime.grid import ProcessGrid, collective_device
from chimera.runtime.p2p import CommTimeout
from chimera.runtime.pipeline import PipelineRuntime
from chimera.runtime.shared import TieSync
from chimera.runtime.transport import current
from chimera.train import faults
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


@dataclass
class RunResult:
    """What rank 0 reports at the end of a run."""

    config: dict
    steps: list[StepLog] = field(default_factory=list)
    records: list[list[tuple]] = field(default_factory=list)  # per rank: (action, start, end, cpu)
    peak_rss_mb: list[float] = field(default_factory=list)
    final_params: dict | None = None  # model-wide name -> tensor, when asked for


def stage_ranges(cfg: TrainConfig, source, n_stages: int) -> list[range]:
    if cfg.partition:
        ranges = parse_partition(cfg.partition, source.num_layers)
        if len(ranges) != n_stages:
            raise UserError(f"--partition gives {len(ranges)} stages, the schedule needs {n_stages}")
        return ranges
    return partition(source.layer_costs(), n_stages)


def loss_weights(source, targets: torch.Tensor, rows: int, n: int) -> dict[int, float]:
    """Per schedule micro-batch: the factor that makes the sum of losses the mini-batch mean
    (a summed loss: over the target tokens of the whole mini-batch, which differ per
    micro-batch for BERT's masks; a mean loss: by the micro-batch's share of the rows)."""
    if source.sums:
        return {m: 1.0 / source.token_count(targets) for m in range(n)}
    return {m: rows / targets.shape[0] for m in range(n)}


def eval_weight(cfg: TrainConfig, source, targets: list[torch.Tensor], rows: int) -> float:
    """The factor of each micro-batch loss (of ``rows`` rows) in the held-out loss: the mean
    over every target token of the evaluation's mini-batches (a mean loss weighted by its
    share of the rows; a summed loss divided by the count of every target token)."""
    if source.sums:
        return 1.0 / sum(source.token_count(t) for t in targets)
    return rows / (cfg.global_batch * len(targets))


def check_heldout(corpus: torch.Tensor, kind: str, seq_len: int) -> None:
    """--eval-every needs at least one sequence in the held-out split (ValueError)."""
    held = len(split_corpus(corpus, "val"))
    need = seq_len + 1 if kind == "gpt2" else seq_len
    if held < need:
        raise UserError(f"--eval-every: the held-out split (the last {VAL_FRACTION:.0%} of the "
                         f"data) has {held} tokens, fewer than one sequence of {need}; give more "
                         "data or drop --eval-every")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class Trainer:
    """One rank of a pipelined run (or the single-process reference)."""

    def __init__(self, cfg: TrainConfig, rank: int = 0, device: torch.device | None = None,
                 corpus: Corpus | None = None):
        """``corpus``: cfg's data as the launcher opened it (``launch``), else read here."""
        self.cfg, self.rank = cfg, rank
        self.device = device or torch.device("cpu")
        self.source = cfg.model_source  # the model, its vocabulary the data's (train/sources.py)
        # rank 0 reads every id of a token file through (the others trust its check: one
        # scan of a 2 GiB file took 2.2 s, once per rank before)
        self.corpus = corpus if corpus is not None else open_data(
            cfg.data_spec, seq_len=self.source.seq_len, scan=rank == 0)
        if cfg.eval_every:
            check_heldout(self.corpus, self.source.kind, self.source.seq_len)
        self.dtype = DTYPE[cfg.dtype]
        self.autocast = AUTOCAST.get(cfg.dtype)
        self.scaler = LossScaler() if cfg.dtype == "fp16" else None
        self.master: MasterWeights | None = None  # bf16-master: the optimizer's float32 copies
        self.last_records: list[ActionRecord] = []  # the last step's action times, when recorded
        if cfg.reference:
            self._build_reference()
        else:
            self._build_pipeline()

    # -- construction -----------------------------------------------------------------
    def _build_reference(self) -> None:
        self.model = self.source.whole(self.cfg.seed).to(self.device, self.dtype)  # ties: one Parameter
        if self.cfg.compile:
            self.model.compile()  # in place: parameter names (checkpoint keys) are unchanged
        self._make_optimizer(list(self.model.parameters()))

    def _make_optimizer(self, params: list[torch.Tensor], matrix: list[bool] | None = None) -> None:
        """``self.params``, what the optimizer updates and clipping scales: the parameters, or
        with bf16-master their float32 masters."""
        if self.cfg.dtype == "bf16-master":
            self.master = MasterWeights(params)
            params = self.master.masters
        self.params = params
        self.optimizer = make_optimizer(params, self.cfg, matrix)

    def _build_pipeline(self) -> None:
        cfg = self.cfg
        schedule = cfg.build_schedule()
        self.schedule = schedule
        self.grid = ProcessGrid(schedule.placement, cfg.data_parallel, self.rank)
        self.ranges = stage_ranges(cfg, self.source, schedule.stages)
        self.ties = self.source.tie_stages(self.ranges)
        self.rows = int(cfg.micro_batch_size * schedule.micro_scale)
        self.runtime = PipelineRuntime(
            schedule, self.grid, self._stage_factory, self.source.loss_fn,
            input_shape=(self.source.seq_len,), input_dtype=torch.long, rows=self.rows,
            recompute=cfg.recompute, autocast=self.autocast, device=self.device,
            comm_timeout=cfg.comm_timeout, shard_optimizer=cfg.shard_optimizer,
            wire_dtype=getattr(torch, WIRE_DTYPES[cfg.wire_dtype]) if cfg.wire_dtype else None)
        # unchanged unless a drill
        self.runtime.program = faults.program_for(self.runtime.program, schedule, self.rank)
        # a weight tied across stages: a copy per stage, equal at start, gradients summed
        self.tie_sync = TieSync(self.ties, self.runtime)  # its groups: same order on every rank
        self.tie_sync.equalize()
        tensors = self.runtime.optimizer_parameters()
        self._make_optimizer([t for t, _ in tensors], [m for _, m in tensors])

    def _stage_factory(self, stage: int) -> torch.nn.Module:
        module = self.source.stage(self.ranges[stage], self.cfg.seed, self.ties).to(self.dtype)
        if self.cfg.compile:
            module.compile()  # in place: parameter names (checkpoint keys) are unchanged
        return module

    # -- one step -------------------------------------------------------------------------
    def batch(self, step: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Training: the ``step_batch`` rows of optimizer step ``step``; held-out: a mini-batch."""
        rows = self.cfg.step_batch if split == "train" else self.cfg.global_batch
        return get_batch(self.corpus, step, rows, self.source.seq_len,
                         self.cfg.seed, self.source.kind, split=split,
                         vocab_size=self.source.vocab_size)

    def step(self, step: int, record: list[ActionRecord] | None = None, on_grads=None) -> StepLog:
        """Forward, backward and gradient sync of ``grad_accum`` mini-batches, clipping and
        the optimizer step of ``step``.

        ``on_grads(trainer)``, if given, sees the synchronized gradients before clipping.
        """
        start = time.perf_counter()
        inputs, targets = self.batch(step)
        if record is None and self.cfg.tensorboard:  # --tensorboard times every step
            record = []
        self.last_records = record if record is not None else []
        try:
            loss = self._backward(inputs, targets, record)
            if self.master is not None:
                self.master.grads_to_masters()
            if on_grads is not None:
                on_grads(self)
            norm = self._clip()
        except CommTimeout as exc:  # a hang or a dead peer: say where every rank was
            raise faults.explain(exc, self.schedule, self.grid) from exc
        lr = lr_at(self.cfg, step)
        skipped = not (math.isfinite(loss) and math.isfinite(norm))
        overflow = skipped and self.scaler is not None and math.isfinite(loss)
        if self.scaler is not None:  # float16 overflowed: a smaller scale, not an error
            self.scaler.update(overflow)
        if skipped and not (self.cfg.skip_nonfinite or overflow):
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
        if not self.cfg.reference:
            self.runtime.gather_parameters()  # sharded: every replica gets every slice

    def _backward(self, inputs, targets, record) -> float:
        """The step's loss (unscaled); the summed gradients of its ``grad_accum`` mini-batches
        left in the parameters' .grad, divided by the loss scale where there is one."""
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if self.cfg.reference:
            loss = self._reference_backward(inputs, targets, scale)
        else:  # the micro-batches' loss weights carried the scale
            loss = self._pipeline_backward(inputs, targets, record, scale) / scale
        if self.scaler is not None:
            held = [p.grad for p in self.params] if self.cfg.reference else self.runtime.grad_tensors()
            self.scaler.unscale_([g for g in held if g is not None])
        return loss

    def _accumulated(self, inputs, targets):
        """The step's batch as ``grad_accum`` mini-batches of ``global_batch`` rows each."""
        rows = self.cfg.global_batch
        return [(inputs[i:i + rows], targets[i:i + rows]) for i in range(0, inputs.shape[0], rows)]

    def _reference_backward(self, inputs, targets, scale: float = 1.0) -> float:
        """The step's loss; the gradients of ``scale`` times it in .grad."""
        self.optimizer.zero_grad(set_to_none=False)
        if self.master is not None:
            self.model.zero_grad(set_to_none=False)
        total = 0.0
        for x, t in self._accumulated(inputs, targets):
            loss = self._reference_loss(x, t)
            # each mini-batch's share of the step's mean: its rows, or its summed tokens
            loss = loss / self.source.token_count(targets) if self.source.sums else \
                loss * (x.shape[0] / inputs.shape[0])
            (loss * scale).backward()
            total += float(loss.detach())
        return total

    def _reference_loss(self, inputs, targets) -> torch.Tensor:
        """The single-process model's loss: a mean, or a sum over target tokens (``sums``)."""
        with torch.autocast(self.device.type, dtype=self.autocast or torch.bfloat16,
                            enabled=self.autocast is not None):
            out = self.model(inputs.to(self.device))
            return self.source.loss_fn(out, targets.to(self.device))

    def _pipeline_backward(self, inputs, targets, record, scale: float = 1.0) -> float:
        """``scale`` times the step's loss, and the gradients of it. Every mini-batch runs the
        whole schedule (its gradient sync included); the sums of the earlier ones are put
        aside and added back, as ``Pipeline.step(accumulate=True)`` does."""
        weight = loss_weights(self.source, targets, self.rows, 1)[0] * scale
        parts = self._accumulated(inputs, targets)
        kept, local = None, 0.0
        for i, (x, t) in enumerate(parts):
            if i:
                kept = [g.clone() for g in self.runtime.grad_tensors()]
            self.runtime.zero_grad()
            last = i == len(parts) - 1
            local = local + self.runtime.run(self._micro_data(x, t, weight), record if last else None)
            self.tie_sync.reduce_grads()
            for g, k in zip(self.runtime.grad_tensors(), kept or []):
                g += k
        total = torch.as_tensor(local, dtype=torch.float64, device=collective_device()).reshape(1)
        faults.collective("all-reduce of the loss", current().all_reduce, total)
        return float(total.item())

    def _micro_data(self, inputs, targets, weight: float | None = None) -> MicroData:
        """This rank's micro-batches of a mini-batch; ``weight``: every micro-batch's loss
        factor (default: the one that makes the summed losses the mini-batch mean)."""
        s, grid, rows = self.schedule, self.grid, self.rows
        per_replica = s.micro_batches * rows
        lo = grid.w * per_replica
        if weight is None:
            weights = loss_weights(self.source, targets, rows, s.micro_batches)
        else:
            weights = {m: weight for m in range(s.micro_batches)}
        inputs = to_device(inputs[lo:lo + per_replica], self.device)  # one copy per step
        mine = to_device(targets[lo:lo + per_replica], self.device)
        data = MicroData(weights=weights)
        held = set(grid.held())
        for m, pipe in enumerate(s.micro_pipe):
            if (pipe, 0) in held:
                data.inputs[m] = inputs[m * rows:(m + 1) * rows]
            if (pipe, s.stages - 1) in held:
                data.targets[m] = mine[m * rows:(m + 1) * rows]
        return data

    # -- held-out loss ------------------------------------------------------------------
    def evaluate(self) -> float:
        """The loss on the first ``eval_batches`` mini-batches of the held-out split (the same
        ones at every evaluation, so evaluations compare): the mean over their target tokens.

        Forwards only (the schedule's forward-only program and its own comm plan, the one
        ``chimera.api.Pipeline.eval_step`` runs), in eval mode (dropout off), without autograd;
        gradients, optimizer state, RNG and train mode are as they were. Every micro-batch's
        loss is computed once in the whole world and summed in float64, so every layout gives
        the single-process value. Collective: every rank calls it.
        """
        batches = [self.batch(i, "val") for i in range(self.cfg.eval_batches)]
        rows = self.cfg.global_batch if self.cfg.reference else self.rows
        weight = eval_weight(self.cfg, self.source, [t for _, t in batches], rows)
        with self._eval_mode():
            try:
                local = sum(self._forward_loss(x, t, weight) for x, t in batches)
            except CommTimeout as exc:
                raise faults.explain(exc, self.runtime.eval_schedule, self.grid) from exc
        if self.cfg.reference:
            return float(local)
        total = torch.as_tensor(local, dtype=torch.float64, device=collective_device()).reshape(1)
        faults.collective("all-reduce of the held-out loss", current().all_reduce, total)
        return float(total.item())

    def probe_loss(self, step: int) -> float:
        """The loss of the current weights on training mini-batch ``step``, forwards only (as
        :meth:`evaluate`: eval mode, no autograd, training unchanged): how the final
        checkpoint of a run, which no step follows, is judged. Collective."""
        inputs, targets = self.batch(step)
        with self._eval_mode():
            if self.cfg.reference:
                loss = self._reference_loss(inputs, targets).double()
                return float(loss / self.source.token_count(targets) if self.source.sums else loss)
            try:
                local = self.runtime.run_forward(self._micro_data(inputs, targets))
            except CommTimeout as exc:
                raise faults.explain(exc, self.runtime.eval_schedule, self.grid) from exc
        total = torch.as_tensor(local, dtype=torch.float64, device=collective_device()).reshape(1)
        faults.collective("all-reduce of the probe loss", current().all_reduce, total)
        return float(total.item())

    @contextlib.contextmanager
    def _eval_mode(self):
        modules = [self.model] if self.cfg.reference else list(self.runtime.modules.values())
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), \
                torch.no_grad():
            for m in modules:
                m.eval()
            try:
                yield
            finally:
                for m in modules:
                    m.train()

    def _forward_loss(self, inputs, targets, weight: float) -> torch.Tensor:
        """This rank's share of the held-out loss of one mini-batch (a float64 scalar)."""
        if not self.cfg.reference:
            return self.runtime.run_forward(self._micro_data(inputs, targets, weight))
        return self._reference_loss(inputs, targets).double() * weight

    def _clip(self) -> float:
        """Clip by the global norm, each stage counted once (not once per replica)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.cfg.reference:
            sq, reduce = sum_of_squares(grads), None
        else:
            sq = (self.runtime.owned_sq_norm() - self._tie_excess()).to(collective_device())
            reduce = functools.partial(faults.collective, "all-reduce of the gradient norm",
                                       current().all_reduce)
        return float(clip_by_global_norm_(grads, sq, self.cfg.clip or None, all_reduce=reduce))

    def _tie_excess(self) -> torch.Tensor:
        """``owned_sq_norm`` counts each stage once, so a tie in k stages k times: the squares
        of its copies outside its first stage, each stage's once (by its first replica rank),
        to take away. (Ties with a sharded optimizer are refused.)"""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        elsewhere, seen = self.tie_sync.counted_elsewhere(), set()
        for (_, stage), module in sorted(self.runtime.modules.items()):
            if stage in seen or self.grid.rank != self.grid.stage_ranks[stage][0]:
                continue
            seen.add(stage)
            for p in module.parameters():
                if id(p) in elsewhere and p.grad is not None:
                    total += p.grad.detach().double().pow(2).sum()
        return total

    def equalize_ties(self) -> None:
        """Every copy of a tied weight takes its first stage's value (after a load); with
        bf16-master, every parameter first takes its master's (what was loaded)."""
        if self.master is not None:
            self.master.masters_to_params()
        if not self.cfg.reference:
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
        shards = {} if self.cfg.reference else self.runtime.shards
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
        for shard in ({} if self.cfg.reference else self.runtime.shards).values():
            shard.scatter_state(self.optimizer, whole)

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (AdamW: two moments per element it updates)."""
        return sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                   for t in st.values() if isinstance(t, torch.Tensor))

    def _saved(self, p: torch.Tensor) -> torch.Tensor:
        """What a checkpoint holds for parameter ``p``: itself, or with bf16-master its master
        (the float32 weights the optimizer state belongs to)."""
        return p if self.master is None else self.master.master_of()[id(p)]

    def replica_parameters(self) -> list[tuple[str, int, torch.Tensor]]:
        """(model-wide name, pipe, parameter) for every replica this rank holds (masters,
        with bf16-master)."""
        if self.cfg.reference:
            return [(self.source.key(n), 0, self._saved(p)) for n, p in self.model.named_parameters()]
        self.runtime.finish_gather()  # sharded: the last step's all-gathers are complete
        return [(self.source.key(n), pipe, self._saved(p))
                for (pipe, stage), module in sorted(self.runtime.modules.items())
                for n, p in module.named_parameters()]

    def checkpoint_parameters(self) -> dict[str, torch.Tensor]:
        """Model-wide name -> parameter of the replicas this rank writes to a checkpoint:
        pipe 0's in data replica 0, so each stage once, spread over the D ranks; a tie once,
        from its first stage."""
        if self.cfg.reference:
            return {n: p for n, _, p in self.replica_parameters()}
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
