"""Bring your own model: pipeline-train any sequence of layers with any schedule.

Example (runs as is; see ``examples/byo_model.py`` and ``examples/gpt_tied.py``)::

    import torch
    from torch import nn
    import chimera.api as chimera

    def make_layers():                    # called on every rank with the same seed
        return [nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)]

    def main(rank, world):                # one call per process
        pipe = chimera.Pipeline(make_layers, nn.functional.mse_loss, schedule="chimera",
                                stages=2, micro_batches=4, micro_batch_size=8)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        for step in range(100):
            g = torch.Generator().manual_seed(step)           # the same mini-batch on every rank
            x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
            opt.zero_grad()
            loss = pipe.step(x, y)                            # forward, backward, gradient sync
            pipe.clip_grad_norm_(1.0)
            opt.step()

    if __name__ == "__main__":            # spawn starts fresh processes that import this file
        chimera.spawn(main, world=2)      # or run main under torchrun

Conventions (the same as ``nn.Sequential`` with pytrees):

- A layer takes what the previous one returned: a tuple is spread over its arguments
  (``layer(*x)``), anything else (a tensor, a dict) is passed as is. Boundaries may be any
  pytree of tensors (float and integer leaves: hidden states with an int mask), with shapes
  that depend only on the input's shape; gradients flow back through the floating leaves.
- ``step(inputs, targets)``: tensors or pytrees whose tensor leaves all have the mini-batch
  (W x N x micro_batch_size rows) first; every rank gets the whole mini-batch and takes its
  rows. The last stage's output reaches ``loss_fn(output, target)`` (``loss_fn(*output,
  target)`` for a tuple, so extra outputs such as an auxiliary loss reach it too).
- ``LossOptions(reduction=...)``: ``"mean"``: ``loss_fn`` returns the mean over its micro-batch, the
  step's loss is the mini-batch mean; ``"sum"``: ``loss_fn`` returns a sum, the loss is the
  sum; ``"token_mean"``: ``loss_fn`` returns a sum over tokens (e.g. ``cross_entropy(...,
  reduction="sum")``) and the loss is divided by the number of targets != ``ignore_index``
  in the whole mini-batch (all micro-batches and data-parallel copies): padding does not
  change the gradient. With several target tensors, or targets the loss shifts (labels =
  input ids, shifted inside ``loss_fn``), pass ``LossOptions(token_count=fn(targets))``: the number of
  tokens the loss sums over in the whole mini-batch.
- Every rank must be given the same mini-batch: ``step`` compares a fingerprint of it across
  ranks (one small allreduce; ``ExecOptions(check_batch=False)`` skips it) and refuses a mismatch.
- Exact: the gradient equals single-device training on the same mini-batch (tests check
  1e-10 in float64), for models whose layers see rows independently. Layers that mix rows
  (BatchNorm in training mode) see one micro-batch at a time, as under any pipeline: their
  batch statistics are per micro-batch, and the running statistics of a stage's replicas are
  averaged at every step (``ExecOptions(sync_buffers=True)``), so replicas stay equal but the statistics
  differ from one device's; ``num_batches_tracked`` counts every micro-batch of every replica,
  as one device running the micro-batches one by one counts them.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Callable, Mapping, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from chimera.byo import LayerSource, build_layers, check_partition, refuse_sharded_ties
from chimera.errors import UserError
from chimera.ir import Schedule, ScheduleError
from chimera.models.lora import LoRAOptions, Tuning, refuse_tied_targets, refuse_unused
from chimera.passes import lower
from chimera.runtime.allocator import keep_freed_memory
from chimera.runtime.boundary import signature
from chimera.runtime.clip import EPS as CLIP_EPS, clip_by_global_norm_
from chimera.runtime.executor import ActionRecord, MicroData, to_device
from chimera.runtime.context import ExecOptions, RunContext, RuntimeOptions
from chimera.runtime.grid import ProcessGrid
from chimera.runtime.launch_local import SpawnError, spawn
from chimera.runtime.nccl_emulation import emulation
from chimera.runtime.p2p import peers_text, wait_work
from chimera.runtime.pipeline import PipelineRuntime, ProbeError
from chimera.runtime.shared import TieSync, counters, sync_buffers
from chimera.runtime.transport import ReduceOp, Transport
from chimera.schedules import build, default_micro_batches, require_runnable
from chimera.tp import (ShardedLogits, TPGroup, TPRandom, accepts_sharded_logits, full_tensor, local_slice,
                        parallelize, shard_of)
from chimera.check.validate import validate

__all__ = ["ExecOptions", "LoRAOptions", "LossOptions", "ModelOptions", "Pipeline", "ProbeError",
           "RunContext", "RuntimeOptions", "SpawnError", "balanced_partition", "build_layers",
           "spawn"]
REDUCTIONS = ("mean", "sum", "token_mean")


def balanced_partition(layers: Sequence[nn.Module], parts: int) -> list[range]:
    """Contiguous ranges balancing parameter counts (layers without weights count a little)."""
    from chimera.models.partition import partition

    costs = [1.0 + sum(p.numel() for p in layer.parameters()) for layer in layers]
    return partition(costs, parts)


@dataclass(frozen=True)
class ModelOptions:
    """How the layers are built and cut. ``num_layers``: with it, ``layers`` is
    ``make_layer(i)`` building one layer (a rank then builds only the layers it holds; see
    :mod:`chimera.byo`); ``partition``: one range of layer indices per stage (default
    balanced by parameter count); ``seed``: what ``make_layers`` is called with (the caller's
    RNG untouched); ``ties``: shared Parameters by name, beside those found by identity;
    ``init(module)``: initializes a layer built on the meta device; ``compile``:
    ``torch.compile`` every stage module (True, or its keyword arguments as a dict);
    ``tp_plan``: how each layer is sharded over ``tensor_parallel`` ranks, as torch and HF
    write it: a mapping of model-wide submodule name patterns (``"*.attn.qkv"``: the layer
    index first, as in ``nn.Sequential(*layers)``) to torch ``ParallelStyle``s or HF
    ``base_model_tp_plan`` strings, or ``tp_plan(index, layer)`` returning one layer's plan
    (patterns relative to the layer) or None (see :mod:`chimera.tp` for the built-in plans);
    ``freeze``: globs over model-wide parameter names (``"0.*"``, ``"*.ln_*"``) whose
    parameters do not train (no gradient, no optimizer state, no allreduce, not in the
    gradient norm; a tied weight frozen under any of its names is frozen in every copy);
    ``lora``: :class:`~chimera.models.lora.LoRAOptions`, adapters on the linear layers its
    targets name, every base weight frozen (see :mod:`chimera.models.lora`)."""

    num_layers: int | None = None
    partition: Sequence | None = None
    seed: int = 0
    ties: Sequence[Sequence[str]] | None = None
    init: Callable[[nn.Module], None] | None = None
    compile: bool | dict = False
    tp_plan: Mapping | Callable | None = None
    freeze: Sequence[str] = ()
    lora: LoRAOptions | None = None

    def __post_init__(self) -> None:
        if isinstance(self.freeze, str):
            raise UserError(f"freeze must be a list of patterns, got the string {self.freeze!r}")
        if self.lora is not None and not isinstance(self.lora, LoRAOptions):
            raise UserError(f"lora must be a LoRAOptions, got {type(self.lora).__name__}")


@dataclass(frozen=True)
class LossOptions:
    """How micro-batch losses make the step's loss (see the module's conventions):
    ``reduction`` is ``mean``, ``sum`` or ``token_mean``; ``ignore_index``: targets that do
    not count for ``token_mean``; ``token_count(targets)``: the tokens the loss sums over in
    the whole mini-batch, where they are not the targets != ``ignore_index``."""

    reduction: str = "mean"
    ignore_index: int = -100
    token_count: Callable | None = None

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise UserError(f"loss reduction must be one of {REDUCTIONS}, got {self.reduction!r}")


def _check_sizes(micro_batch_size, micro_batches, tensor_parallel) -> None:
    """Sizes refused in one line here rather than as a ZeroDivisionError deep in the runtime."""
    for name, value, optional in (("micro_batch_size", micro_batch_size, False),
                                  ("micro_batches", micro_batches, True),
                                  ("tensor_parallel", tensor_parallel, False)):
        if optional and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"{name} must be a positive integer, got {value!r}")


def _fingerprint(tree) -> torch.Tensor:
    """Five float64 numbers that differ, in practice, between two different mini-batches:
    tensor count, elements, sum, a position-weighted sum (a permutation changes it) and a
    weighted sum of the shapes (the same values in another shape change it)."""
    out = torch.zeros(5, dtype=torch.float64)
    for t in pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            x = torch.nan_to_num(t.detach().reshape(-1).double().cpu(), 0.0, 1e300, -1e300)
            w = 1.0 + (torch.arange(x.numel(), dtype=torch.float64) % 251) / 251
            shape = sum((k + 1) * 1009.0 ** k * n for k, n in enumerate(t.shape))
            out += torch.tensor([1.0, x.numel(), x.sum(), (x * w).sum(), shape],
                                dtype=torch.float64)
    return out


class _BatchCheck:
    """Every rank takes its own rows from the mini-batch it is given, so all must be given the
    same one (a per-rank seed or a per-rank data loader would silently pair one rank's
    inputs with another's targets): compare fingerprints, one small allreduce.

    The allreduce is started here (in the rank's one order of operations:
    ``PipelineRuntime.all_reduce_async``, first of the step on every rank) and its answer
    read by :meth:`wait`, so its latency (a ring over every rank) hides behind the step's
    compute instead of delaying every rank's first action; the step waits for it before it
    returns, so a mismatch is refused before the caller's optimizer step."""

    def __init__(self, tree, runtime: PipelineRuntime):
        self.runtime = runtime
        mine = _fingerprint(tree)
        self.both = torch.cat([mine, -mine]).to(runtime.context.collective_device)
        self.work = runtime.all_reduce_async(self.both, op=ReduceOp.MAX)

    MISMATCH = ("the ranks were given different mini-batches: every rank must pass the same "
                "whole mini-batch to step()/eval_step() (seed its generator or loader alike on "
                "every rank; each rank takes its own rows from it)")

    def wait(self) -> None:
        """Wait for the comparison; UserError when the ranks' mini-batches differ."""
        if self.work is None:
            return
        rank, ranks = self.runtime.grid.rank, list(range(self.runtime.transport.get_world_size()))
        wait_work(self.work, self.runtime.sync.timeout, rank,
                  f"batch fingerprint allreduce with {peers_text(rank, ranks)}", ranks)
        self.work = None
        high, low = self.both.chunk(2)
        high, low = high.cpu(), -low.cpu()
        if not torch.equal(high, low):
            raise UserError(self.MISMATCH)

    def explain(self, exc: BaseException) -> None:
        """The step failed with ``exc`` while the check was pending: when the ranks' batches
        differ (a rank given another shape went on to other buffers, and the run broke), say
        that instead; otherwise return and let ``exc`` stand."""
        try:
            self.wait()
        except UserError:
            raise UserError(self.MISMATCH) from exc
        except Exception:  # noqa: BLE001 -- the run's own error is the one to report
            return


def _rows(tree, lo: int, hi: int, device=None):
    """Rows ``lo:hi`` of every tensor leaf (on ``device``: pinned, without blocking the host)."""
    def rows(t):
        if not isinstance(t, torch.Tensor):
            return t
        return t[lo:hi] if device is None else to_device(t[lo:hi], device)
    return pytree.tree_map(rows, tree)


def micro_count(schedule: Schedule) -> int:
    """Micro-batches of ``micro_batch_size`` rows a schedule's iteration takes (backward
    halving runs twice as many, of half the rows)."""
    return round(schedule.micro_batches * schedule.micro_scale)


def _lowered(schedule: str | Schedule, stages: int, n: int, options: dict | None,
             sync: str, tensor_parallel: int = 1) -> Schedule:
    """The lowered, validated schedule (its order checked with ``tensor_parallel`` ranks per
    pipeline rank): ``schedule`` built by name, or given (lowered here unless it is already)."""
    if isinstance(schedule, Schedule):
        return schedule if schedule.lowered else validate(lower(schedule, sync), tensor_parallel)
    require_runnable(schedule)
    return validate(lower(build(schedule, stages, n, **(options or {})), sync), tensor_parallel)


def _build_stage(source: LayerSource, ranges: list[range], ties, device, compile_opts, shard,
                 tuning: Tuning, stage: int):
    if not tuning.active:
        return source.stage(ranges[stage], ties, device, compile_opts, shard)
    return source.stage(ranges[stage], ties, device, compile_opts, shard, tuning.layer,
                        tuning.stage)


def layer_plan(plan, index: int, layer: nn.Module, used: set | None = None):
    """Layer ``index``'s own plan (patterns relative to it) from a model-wide ``plan``: the
    entries whose first name part matches the index and whose rest names a submodule of the
    layer; or what ``plan(index, layer)`` returns. None: the layer stays whole. ``used``
    collects the model-wide patterns that named something here."""
    if plan is None:
        return None
    if callable(plan) and not isinstance(plan, Mapping):
        return plan(index, layer)
    names = [n for n, _ in layer.named_modules() if n]
    out = {}
    for pattern, style in plan.items():
        first, _, rest = pattern.partition(".")
        if fnmatchcase(str(index), first) and rest and any(fnmatchcase(n, rest) for n in names):
            out[rest] = style
            if used is not None:
                used.add(pattern)
    return out or None


def _check_plan(plan, num_layers: int) -> None:
    """A model-wide pattern whose layer part matches no layer index is refused (a typo
    would otherwise leave every layer whole without a word)."""
    if plan is None or (callable(plan) and not isinstance(plan, Mapping)):
        return
    for pattern in plan:
        first = pattern.partition(".")[0]
        if not any(fnmatchcase(str(i), first) for i in range(num_layers)):
            raise UserError(f"tp_plan pattern {pattern!r} names no layer: model-wide patterns "
                            f"start with a layer index (0-{num_layers - 1}) or a wildcard, "
                            f"as in '*.attn.qkv'")


def _shard(plan, tp: TPGroup, used: set, sharded_logits: bool, index: int, layer: nn.Module) -> nn.Module:
    sub = layer_plan(plan, index, layer, used)
    return layer if not sub else parallelize(layer, sub, tp, sharded_logits=sharded_logits)


def _whole(x):
    """An output leaf as the caller sees it: sharded logits gathered (a collective over TP)."""
    return x.full() if isinstance(x, ShardedLogits) else x


def _join(column: list):
    """One output leaf over the micro-batches: rows concatenated; 0-dim tensors (a value per
    micro-batch) stacked; anything else (not a tensor) taken from the first."""
    if not isinstance(column[0], torch.Tensor):
        return column[0]
    if column[0].dim() == 0:
        return torch.stack(column)
    return torch.cat(column)


class Pipeline:
    """This rank's share of a pipelined model. Construct it on every rank, same arguments.

    ``layers`` is ``make_layers()`` returning every layer (called with the seed, the
    caller's RNG untouched), a list of layers, or ``make_layer(i)`` building one layer
    (``ModelOptions(num_layers=...)``). Shared Parameters (tied weights) are found by
    identity, or named in ``ModelOptions.ties``. ``schedule`` is a scheme's name, or a
    :class:`~chimera.ir.Schedule` built already (its ``placement.ranks`` is then ``stages``;
    lowered here with ``options.sync`` unless it is). The grouped options: ``model``
    (:class:`ModelOptions`: layers, partition, seed, ties, init, compile), ``loss``
    (:class:`LossOptions`: reduction, ignore_index, token_count), ``options``
    (:class:`~chimera.runtime.context.ExecOptions`: schedule options, sync, recompute,
    autocast, wire dtype, sharded optimizer, buffer sync, batch check). ``example_input``
    (and ``example_target``; optional, one row or a micro-batch, a pytree) sizes the
    boundaries now; otherwise the first ``step`` does, and a new input shape re-probes.
    ``context``: the run's transport, device and runtime options
    (:class:`~chimera.runtime.context.RunContext`; default :meth:`RunContext.here`:
    ``torch.distributed``, ``cuda:LOCAL_RANK`` under NCCL, options from ``CHIMERA_*``).
    """

    def __init__(self, layers, loss_fn: Callable, schedule: str | Schedule = "chimera",
                 stages: int = 2, micro_batches: int | None = None, micro_batch_size: int = 1,
                 data_parallel: int = 1, *, tensor_parallel: int = 1,
                 model: ModelOptions | None = None,
                 loss: LossOptions | None = None, options: ExecOptions | None = None,
                 example_input=None, example_target=None, context: RunContext | None = None):
        self.context = context if context is not None else RunContext.here()
        self.transport = self.context.transport
        model, self.loss = model or ModelOptions(), loss or LossOptions()
        self.options = options = options or ExecOptions()
        _check_sizes(micro_batch_size=micro_batch_size, micro_batches=micro_batches,
                     tensor_parallel=tensor_parallel)
        if isinstance(schedule, Schedule):  # built already (chimera train's config builds it)
            stages, n = schedule.placement.ranks, micro_batches or micro_count(schedule)
        else:
            n = micro_batches or default_micro_batches(stages, schedule)
        self._check_args(self.transport, stages, data_parallel, tensor_parallel)
        keep_freed_memory(self.context.options.malloc)  # this process trains (torchrun too)
        self.schedule = _lowered(schedule, stages, n, options.schedule_options, options.sync,
                                 tensor_parallel)
        self._prefetching = False  # the caller gathers after each optimizer step
        self.grid = ProcessGrid(self.schedule.placement, data_parallel, self.transport.get_rank(),
                                tensor_parallel)
        self._agree_on_layout()
        self.batch_rows = micro_batch_size * n * data_parallel
        self.rows = int(micro_batch_size * self.schedule.micro_scale)
        if self.rows * self.schedule.micro_batches * data_parallel != self.batch_rows:
            raise UserError(f"micro_batch_size {micro_batch_size} cannot be halved for {schedule}")
        source = LayerSource(layers, model.num_layers, model.seed, model.ties, model.init)
        self.ranges = self._partition(source, model.partition)
        self.collective_stream = None  # the NCCL emulation's, made with the TP group
        self.tp, shard = self._tensor_parallel(model.tp_plan, source.num_layers,
                                               accepts_sharded_logits(loss_fn), model.seed)
        self.ties = source.ties(self.ranges)
        self.tuning = self._tuning(model)
        trained = [t.names[0] for t in self.ties if self.tuning.trains(t.names[0])]
        refuse_sharded_ties(trained if options.shard_optimizer else [])
        device = self.context.device
        if device.type == "cuda":  # NCCL's object collectives (probe, state_dict) use it
            torch.cuda.set_device(device)
        opts = None if not model.compile else ({} if model.compile is True else dict(model.compile))
        stage_of = functools.partial(_build_stage, source, self.ranges, self.ties, device, opts,
                                     shard, self.tuning)
        self.runtime = PipelineRuntime(
            self.schedule, self.grid, stage_of, loss_fn, self.context, options, rows=self.rows,
            example=self._example(example_input, device),
            target_example=self._example(example_target, device),
            collective_stream=self.collective_stream)
        del source, stage_of  # the layers a rank does not hold are garbage now
        if self.tuning.active:
            self._check_tuning_used()
        if self.tp is not None:  # a replicated parameter counts once in a norm: at t = 0
            for module in self.runtime.modules.values():  # recompute replays TP dropout's masks
                module.recompute_context = self.tp.random.recompute_context
            self._check_plan_used(model.tp_plan)
            self._equalize_over_tp()
            self.runtime.set_norm_counted(lambda p: self.grid.t == 0 or shard_of(p) is not None)
        self.tie_sync = TieSync(self.ties, self.runtime)  # its groups: same order on every rank
        self.tie_sync.equalize()

    def _tuning(self, model: ModelOptions) -> Tuning:
        """What trains (``freeze``, ``lora``), refused where it cannot be done right."""
        if model.lora is not None and self.grid.tensor_parallel > 1:
            raise UserError(f"LoRA with tensor_parallel={self.grid.tensor_parallel} is not "
                            "supported: adapters are not sharded; train them with T=1")
        ties = [t.names for t in self.ties]
        refuse_tied_targets(model.lora, ties)
        return Tuning(model.freeze, model.lora, model.seed, ties)

    def _check_tuning_used(self) -> None:
        """A freeze pattern or LoRA target that named nothing on any rank is refused on every
        rank (one small gather at construction)."""
        every: list = [None] * self.transport.get_world_size()
        self.transport.all_gather_object(every, (sorted(self.tuning.used), self.tuning.examples))
        examples = {k: [n for _, e in every for n in e[k]] for k in self.tuning.examples}
        refuse_unused([{tuple(u) for u in used} for used, _ in every], self.tuning.freeze_patterns,
                      self.tuning.lora, examples)

    def _agree_on_layout(self) -> None:
        """Every rank runs the same lowered schedule on the same grid: the T ranks of a
        pipeline rank run its program in lockstep (their layers' collectives pair up), and
        the order of every message and collective is derived from the schedule. A rank given
        another T, W or schedule would hang at its first mismatched collective; here it is
        one line on every rank, naming the ranks. One small gather at construction."""
        g, world = self.grid, self.transport.get_world_size()
        mine = (g.depth, g.data_parallel, g.tensor_parallel,
                hashlib.sha256(self.schedule.to_text().encode()).hexdigest()[:16])
        every: list = [None] * world
        self.transport.all_gather_object(every, mine)
        sizes = {e[0] * e[1] * e[2] for e in every}
        if len(set(every)) == 1 and sizes != {world}:
            raise ScheduleError(f"world size {world} != stages x data_parallel x tensor_parallel "
                                f"= {sizes.pop()}")
        if len(set(every)) > 1:
            seen = "; ".join(f"rank {r}: D={e[0]} W={e[1]} T={e[2]} schedule {e[3]}"
                             for r, e in enumerate(every) if e != every[0])
            raise UserError(f"rank {g.rank}: the ranks disagree on the layout or the schedule "
                            f"(rank 0: D={every[0][0]} W={every[0][1]} T={every[0][2]} schedule "
                            f"{every[0][3]}; {seen}): build the Pipeline with the same arguments "
                            "on every rank")

    def _tensor_parallel(self, plan, num_layers: int, sharded_logits: bool, seed: int):
        """(the TP group, the per-layer sharding for the stage builder), or (None, None) at
        T = 1. The groups are created here, before the stages: a stage's TP layers hold theirs.
        Under the NCCL emulation the TP group talks through its collective stream, made here
        and handed to the runtime: the layers' collectives are gated on the stream of the
        stage collectives (strict: of everything), as NCCL's one-order rule for communicators
        used concurrently asks at worst.
        ``sharded_logits``: the loss takes ``tp.ShardedLogits`` (heads keep them sharded);
        ``seed``: of the TP dropout streams (``tp.TPRandom``)."""
        if self.grid.tensor_parallel == 1:
            return None, None
        if plan is None:
            raise UserError(f"tensor_parallel={self.grid.tensor_parallel} needs a tp_plan "
                            "(ModelOptions(tp_plan=...)): which submodules are sharded how")
        _check_plan(plan, num_layers)
        self.grid.build_groups(self.transport)
        timed = self.transport.timed_waits  # NCCL: its own timeout and watchdog
        timeout = datetime.timedelta(seconds=self.context.options.comm_timeout) if timed else None
        self.collective_stream = emulation(self.transport, self.context.options)
        g = self.grid  # dropout's streams: per pipeline rank (w*D + d), the sharded one per t
        random = TPRandom(seed, g.rank // g.tensor_parallel, g.t, self.context.device)
        tp = TPGroup(self.collective_stream or self.transport, g.tp_group, g.t, g.tensor_parallel,
                     timeout, random)
        self._plan_used: set = set()  # the model-wide patterns that named a submodule here
        return tp, functools.partial(_shard, plan, tp, self._plan_used, sharded_logits)

    @torch.no_grad()
    def _equalize_over_tp(self) -> None:
        """The T ranks of a pipeline rank hold the replicated parameters and buffers alike
        (norms, row-parallel biases): a model built from each rank's own RNG would otherwise
        keep T different copies whose identical gradients never bring them together. t = 0's
        values, one flat broadcast per dtype over the TP group (the replicas' mechanism)."""
        tensors = [t.data for _, module in sorted(self.runtime.modules.items())
                   for t in list(module.parameters()) + list(module.buffers())
                   if shard_of(t) is None and t.is_floating_point()]
        self.runtime.broadcast_flat(tensors, self.grid.tp_ranks[0], self.grid.tp_group)

    def _check_plan_used(self, plan) -> None:
        """What sharding must agree on across ranks, checked once on every rank: a
        model-wide pattern that named a submodule on no rank (``"*.attn.qkvv"``: the layers
        would stay whole without a word), and the copies of a tied weight sharded alike (a
        sharded embedding tied to a whole head cannot be one Parameter)."""
        cuts = {}  # tie -> how each copy this rank holds is cut
        for tie in self.ties:
            for (_, stage), module in sorted(self.runtime.modules.items()):
                for name in tie.names:
                    if name.split(".", 1)[0] in {n for n, _ in module.named_children()}:
                        cuts.setdefault(tie.names[0], set()).add(repr(shard_of(module.get_parameter(name))))
        every: list = [None] * self.transport.get_world_size()
        self.transport.all_gather_object(every, (sorted(self._plan_used), cuts))
        mixed = sorted(name for name in {n for _, c in every for n in c}
                       if len({s for _, c in every for s in c.get(name, ())}) > 1)
        if mixed:
            raise UserError(f"tensor parallel: the copies of tied weight {mixed[0]} are cut "
                            "differently (shard the embedding and the head it is tied to alike)")
        if not isinstance(plan, Mapping):
            return
        unused = sorted(set(plan) - {p for used, _ in every for p in used})
        if unused:
            raise UserError(f"tp_plan pattern(s) {', '.join(map(repr, unused))} name no "
                            "submodule of any layer (patterns: '<layer index>.<submodule>', "
                            "wildcards allowed)")

    @staticmethod
    def _check_args(transport: Transport, stages: int, data_parallel: int, tp: int) -> None:
        if not transport.is_initialized():
            raise RuntimeError("chimera.api.Pipeline needs torch.distributed initialized "
                               "(use chimera.api.spawn or torchrun)")
        # the world size is checked with the other ranks (_agree_on_layout): a rank that
        # raised alone here would leave the others waiting for it

    def _partition(self, source: LayerSource, partition) -> list[range]:
        name, pieces, ranks = self.schedule.name, self.schedule.stages, self.schedule.placement.ranks
        if pieces > source.num_layers:  # say why there are more pieces than the stages asked for
            each = f" ({name} places {pieces // ranks} on each of its {ranks} ranks)" if pieces != ranks else ""
            n = source.num_layers
            raise UserError(f"schedule {name} with stages={ranks} cuts the model into {pieces} "
                            f"pieces{each}, but it has {n} layer{'s' if n != 1 else ''}: give at "
                            f"least {pieces}")
        if partition is None:
            from chimera.models.partition import partition as balance
            partition = balance(source.costs(), self.schedule.stages)
        return check_partition(partition, source.num_layers, self.schedule.stages)

    def _example(self, tree, device):
        """A micro-batch like ``tree`` (its rows cycled to ``rows``)."""
        if tree is None:
            return None
        def cycle(t):
            if not isinstance(t, torch.Tensor):
                return t
            return t[torch.arange(self.rows) % t.shape[0]].to(device)
        return pytree.tree_map(cycle, tree)

    # -- parameters ------------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        """What this rank's optimizer updates: give them to your optimizer. Every replica's
        parameters it holds that train (frozen ones are left out); with
        ``shard_optimizer=True``, this rank's slices of them (flat pieces sharing the
        parameters' memory; their ``.grad`` is the slice of the summed gradient), gathered
        into every replica at the next :meth:`step`, :meth:`eval_step`,
        :meth:`named_parameters`, :meth:`state_dict` or :meth:`sync_parameters`. A rank
        whose stages are all frozen gets its frozen parameters, so that
        ``torch.optim.SGD(pipe.parameters())`` can be built on every rank (they never get a
        gradient: the optimizer skips them)."""
        if self.runtime.shards:
            out = [t for t, _ in self.runtime.optimizer_parameters()]
        else:
            out = [p for p in self.runtime.parameters() if p.requires_grad]
        return out or self.runtime.parameters()

    def named_parameters(self):
        """(model-wide name, parameter) for every replica this rank holds: the names of
        ``nn.Sequential(*layers)`` (``"3.attn.weight"``); a name repeats when a rank holds
        two copies (a second replica, or both ends of a tie). With ``shard_optimizer=True``
        a collective (every rank calls it): the optimizer's slices are gathered first."""
        self.sync_parameters()
        return iter([item for _, module in sorted(self.runtime.modules.items())
                     for item in module.named_parameters()])

    def sync_parameters(self) -> None:
        """With ``shard_optimizer=True``: every replica gets the slices the optimizers
        updated (a collective: call on every rank). Nothing to do otherwise."""
        if self.runtime.shards:
            self.runtime.gather_parameters()
            self.runtime.finish_gather()

    def train(self, mode: bool = True) -> "Pipeline":
        for module in self.runtime.modules.values():
            module.train(mode)
        return self

    def eval(self) -> "Pipeline":
        return self.train(False)

    # -- one step ----------------------------------------------------------------------------
    def _check_rows(self, tree, what: str) -> None:
        for t in pytree.tree_leaves(tree):
            if isinstance(t, torch.Tensor) and (t.dim() == 0 or t.shape[0] != self.batch_rows):
                got = tuple(t.shape)
                raise UserError(f"{what}: expected tensors of {self.batch_rows} rows first "
                                 f"(W x N x micro_batch_size), got a leaf of shape {got}")

    def _micro_data(self, inputs, targets, scale: float, outputs: bool = False,
                    tokens: int | None = None) -> tuple[MicroData, _BatchCheck | None]:
        """The rank's micro-batches, and the started batch check (wait for it before the
        step returns)."""
        s, grid, rows, dev = self.schedule, self.grid, self.rows, self.runtime.device
        self._check_rows(inputs, "inputs")
        if targets is not None:
            self._check_rows(targets, "targets")
        weight = scale * self._loss_weight(targets, tokens)  # (refusals of the input first)
        check = _BatchCheck((inputs, targets), self.runtime) if self.options.check_batch else None
        example = _rows(inputs, 0, rows, dev)
        if check is not None and signature(example) != self.runtime.signature:
            check.wait()  # a new shape is probed with collectives: the ranks must agree first
        self.runtime.prepare(example, None if targets is None else _rows(targets, 0, rows, dev))
        data = MicroData(weights={m: weight for m in range(s.micro_batches)},
                         outputs={} if outputs else None)
        held, lo = set(grid.held()), grid.w * s.micro_batches * rows
        firsts = [m for m, pipe in enumerate(s.micro_pipe) if (pipe, 0) in held]
        lasts = [m for m, pipe in enumerate(s.micro_pipe) if (pipe, s.stages - 1) in held]
        hi = lo + s.micro_batches * rows  # this data-parallel copy's rows: one copy per step
        mine_in = _rows(inputs, lo, hi, dev) if firsts else None
        mine_out = _rows(targets, lo, hi, dev) if lasts and targets is not None else None
        for m in firsts:
            data.inputs[m] = _rows(mine_in, m * rows, (m + 1) * rows)
        for m in lasts if mine_out is not None else ():
            data.targets[m] = _rows(mine_out, m * rows, (m + 1) * rows)
        return data, check

    def _loss_weight(self, targets, tokens: int | None = None) -> float:
        reduction = self.loss.reduction
        if reduction == "mean":
            return self.rows / self.batch_rows
        if reduction == "sum" or targets is None:
            return 1.0
        if tokens is not None:
            count = int(tokens)
        elif self.loss.token_count is not None:
            count = int(self.loss.token_count(targets))
        else:
            leaves = [t for t in pytree.tree_leaves(targets) if isinstance(t, torch.Tensor)]
            if len(leaves) != 1:
                raise UserError(f"loss reduction 'token_mean' with {len(leaves)} target tensors: "
                                 "pass LossOptions(token_count=fn(targets)): the number of tokens the loss "
                                 "sums over (the whole mini-batch)")
            count = int((leaves[0] != self.loss.ignore_index).sum())  # the whole mini-batch
        return 1.0 / max(count, 1)

    def step(self, inputs, targets, accumulate: bool = False, loss_scale: float = 1.0,
             record: list[ActionRecord] | None = None, *, total_tokens: int | None = None) -> float:
        """Forward, backward and gradient sync of one mini-batch; returns its loss.

        Gradients are left in ``.grad`` of :meth:`parameters`; call your optimizer next.
        ``accumulate=False`` starts from zero (as if ``zero_grad()`` came first);
        ``accumulate=True`` adds to the gradients already there, like a second
        ``backward()`` (scale with ``loss_scale`` to average several mini-batches).
        Mini-batches that differ across ranks are refused (UserError) once the forwards and
        backwards ran (the check overlaps them): the refused step's gradients are not to be
        used (accumulated ones are put back as they were), BatchNorm statistics have moved.
        ``total_tokens`` (reduction ``"token_mean"``): divide by this count instead of
        the mini-batch's, e.g. the tokens of every mini-batch accumulated into one optimizer
        step, so that the step's loss is the mean over all of them.
        """
        if targets is None:
            raise UserError("step() needs targets (the loss is computed from them); "
                             "eval_step(inputs) runs the forwards alone")
        data, check = self._micro_data(inputs, targets, loss_scale, tokens=total_tokens)
        self._gather_updated()
        self.runtime.zero_grad(keep=accumulate)
        kept = [t.clone() for t in self.runtime.grad_tensors()] if accumulate else None
        if kept is not None:  # the sums below must cover only this step's gradients
            self.runtime.zero_grad(keep=False)
        counts = counters(self.runtime) if self.options.sync_buffers else None
        loss = self._checked(self.runtime.run, data, check, record)
        if check is not None:  # before the syncs: a refused step leaves ties and buffers alone
            try:
                check.wait()
            except UserError:
                for t, k in zip(self.runtime.grad_tensors(), kept or []):
                    t.copy_(k)  # the gradients accumulated before this step, as they were
                raise
        self.tie_sync.reduce_grads()
        if self.options.sync_buffers:
            sync_buffers(self.runtime, counts)
        for t, k in zip(self.runtime.grad_tensors(), kept or []):
            t += k
        return self._total(loss)

    def _total(self, loss: torch.Tensor) -> float:
        """The step's loss: the sum of every rank's share, each TP group's counted once (its
        T ranks computed the same value)."""
        if self.grid.t != 0:
            loss.zero_()
        self.runtime.all_reduce(loss)
        return float(loss)

    def prefetch_parameters(self) -> None:
        """With ``shard_optimizer=True``: start gathering the slices the optimizer just
        updated (call right after ``optimizer.step()``; a collective). Each replica waits for
        its own at its first forward, so a rank's later stages gather while its first ones
        compute. Once called, gathering is left to the caller: :meth:`step` and
        :meth:`eval_step` no longer gather themselves (so the mini-batches accumulated into
        one update gather once), so call it after every optimizer step. Nothing to do
        without ``shard_optimizer``."""
        if self.runtime.shards:
            self.runtime.gather_parameters()
            self._prefetching = True

    def _gather_updated(self) -> None:
        """Sharded: every replica gets the slices the optimizer updated (unless the caller
        gathers: :meth:`prefetch_parameters`)."""
        if self.runtime.shards and not self._prefetching:
            self.runtime.gather_parameters()  # each replica waits at its first forward

    @staticmethod
    def _checked(run, data, check: _BatchCheck | None, *args):
        """``run(data, *args)``; a failure while the batch check is pending is explained by it
        when the ranks' mini-batches differ."""
        try:
            return run(data, *args)
        except Exception as exc:
            if check is not None:
                check.explain(exc)
            raise

    @torch.no_grad()
    def eval_step(self, inputs, targets=None, return_outputs: bool = False, *,
                  loss_scale: float = 1.0, total_tokens: int | None = None):
        """Forwards only (no gradients, no sync; run ``eval()`` first for dropout/BatchNorm):
        the mini-batch loss (None without targets), and with ``return_outputs`` also the last
        stage's outputs for the whole mini-batch, on every rank, in row order (a 0-dim leaf,
        such as an auxiliary loss per micro-batch, as a vector of one value per micro-batch).
        ``loss_scale`` and ``total_tokens`` weigh the loss as in :meth:`step`."""
        data, check = self._micro_data(inputs, targets, loss_scale, outputs=return_outputs,
                                       tokens=total_tokens)
        self._gather_updated()
        loss = self._checked(self.runtime.run_forward, data, check)
        if check is not None:
            check.wait()
        loss = self._total(loss)
        loss = None if targets is None else loss
        if not return_outputs:
            return loss
        return loss, self._gather_outputs(data.outputs)

    def _gather_outputs(self, mine: dict):
        """Every rank's last-stage outputs, merged in row order on every rank. Under TP the T
        ranks of a last stage hold the same whole outputs once gathered: t = 0's go."""
        w, n = self.grid.w, self.schedule.micro_batches
        # sharded logits gathered whole first: every TP rank of the last stage holds the same
        # micro-batches, and gathers them in one order; then t = 0's go to the ranks
        whole = {m: pytree.tree_map(_whole, mine[m]) for m in sorted(mine)}
        local = {w * n + m: pytree.tree_map(lambda t: t.detach().cpu(), y) for m, y in whole.items()
                 if self.grid.t == 0}
        parts: list = [None] * self.transport.get_world_size()
        self.transport.all_gather_object(parts, local)
        merged = {k: v for p in parts for k, v in p.items()}
        ordered = [merged[k] for k in sorted(merged)]
        leaves = [pytree.tree_flatten(y)[0] for y in ordered]
        spec = pytree.tree_flatten(ordered[0])[1]
        return pytree.tree_unflatten([_join(col) for col in zip(*leaves)], spec)

    # -- model in and out ------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float | None, eps: float = CLIP_EPS,
                        parameters=None) -> torch.Tensor:
        """Clip the gradients by the model's global 2-norm (each stage once, each tie once)
        and return that norm: the value ``torch.nn.utils.clip_grad_norm_`` gives on one device.
        ``max_norm=None`` measures it and clips nothing. ``parameters`` (default
        :meth:`parameters`): the tensors whose ``.grad`` is scaled, where the optimizer updates
        others holding the same gradients (float32 masters of bf16 weights). A collective."""
        sq = (self.runtime.owned_sq_norm() - self._tie_excess()).to(self.context.collective_device)
        params = self.parameters() if parameters is None else parameters
        grads = [p.grad for p in params if p.grad is not None]
        return clip_by_global_norm_(grads, sq, max_norm, eps, all_reduce=self.runtime.all_reduce)

    def _tie_excess(self) -> torch.Tensor:
        """``owned_sq_norm`` counts each stage once, so a tie in k stages k times: the squares
        of its copies outside its first stage, each stage's once (by its first replica rank),
        to take away. (Ties with a sharded optimizer are refused.)"""
        total = torch.zeros((), dtype=torch.float64, device=self.runtime.device)
        elsewhere, seen = self.tie_sync.counted_elsewhere(), set()
        for (_, stage), module in sorted(self.runtime.modules.items()):
            if stage in seen or self.grid.rank != self.grid.stage_ranks[stage][0]:
                continue
            seen.add(stage)
            for p in module.parameters():
                if self.tp is not None and self.grid.t != 0 and shard_of(p) is None:
                    continue  # replicated over TP: counted at t = 0 only
                if id(p) in elsewhere and p.grad is not None:
                    total += p.grad.detach().double().pow(2).sum()
        return total

    def _owner(self, stage: int) -> int:
        return self.grid.global_rank(self.grid.placement.rank_of(0, stage), 0)

    def _whole_state(self, module: nn.Module) -> dict:
        """``module.state_dict()`` with every tensor whole (a TP shard gathered over the TP
        group: every TP rank calls it), on the CPU."""
        if self.tp is None:
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        params = dict(module.named_parameters(remove_duplicate=False))
        return {k: full_tensor(v.detach(), shard_of(params[k]) if k in params else None,
                               self.tp).cpu().clone()
                for k, v in module.state_dict().items()}

    def state_dict(self, all_ranks: bool = False) -> dict:
        """The whole model's state dict, named as ``nn.Sequential(*layers)``'s, gathered on
        rank 0 (on every rank with ``all_ranks``; ``{}`` elsewhere). Tied names map to one
        tensor (``torch.save`` stores it once). Call on every rank."""
        self.sync_parameters()
        part = {}
        for (pipe, stage), module in sorted(self.runtime.modules.items()):
            if pipe == 0 and self.grid.rank == self._owner(stage):
                whole = self._whole_state(module)  # (collective over TP: every t calls it)
                if self.grid.t == 0:
                    part.update(whole)
        parts: list = [None] * self.transport.get_world_size()
        if all_ranks:
            self.transport.all_gather_object(parts, part)
        else:
            self.transport.gather_object(part, parts if self.grid.rank == 0 else None, dst=0)
            if self.grid.rank != 0:
                return {}
        merged = {k: v for p in parts for k, v in p.items()}
        for tie in self.ties:
            for name in tie.names[1:]:
                merged[name] = merged[tie.names[0]]
        order = {k: i for i, k in enumerate(self._all_keys(parts))}
        return dict(sorted(merged.items(), key=lambda kv: order[kv[0]]))

    def _local(self, value: torch.Tensor, param) -> torch.Tensor:
        """This rank's part of a whole tensor (its TP slice of a sharded parameter)."""
        if self.tp is None or param is None:
            return value
        return local_slice(value, shard_of(param), self.tp)

    @staticmethod
    def _all_keys(parts) -> list[str]:
        """Keys in model order: by layer index, then in each stage's own order."""
        keys = [k for p in parts for k in p]
        pos = {k: i for i, k in enumerate(keys)}
        return sorted(keys, key=lambda k: (int(k.split(".", 1)[0]), pos[k]))

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Load a whole-model state dict (as :meth:`state_dict` returns, or the state dict of
        ``nn.Sequential(*layers)``) on every rank; each rank copies what it holds. Tied copies
        take the value of the tie's first name."""
        self.runtime.finish_gather()  # a pending all-gather would overwrite what is loaded
        state = dict(state)
        for tie in self.ties:
            src = next((n for n in tie.names if n in state), None)
            for name in tie.names if src is not None else ():
                state[name] = state[src]
        keys, missing = set(), []
        for module in self.runtime.modules.values():
            own = module.state_dict().keys()
            keys |= set(own)
            missing += [k for k in own if k not in state]
        everyone: list = [None] * self.transport.get_world_size()
        self.transport.all_gather_object(everyone, (sorted(keys), sorted(set(missing))))
        known = {k for ks, _ in everyone for k in ks}
        missing = sorted({k for _, ms in everyone for k in ms})
        unexpected = sorted(set(state) - known)
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing[:8]}, unexpected keys "
                           f"{unexpected[:8]}")
        for module in self.runtime.modules.values():
            own = module.state_dict().keys()
            params = dict(module.named_parameters(remove_duplicate=False))
            module.load_state_dict({k: self._local(state[k], params.get(k)) for k in own
                                    if k in state}, strict=False)
        self.tie_sync.equalize()
