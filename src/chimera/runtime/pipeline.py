"""PipelineRuntime: build what one rank holds for a lowered schedule and run iterations."""

from __future__ import annotations

from typing import Callable

import contextlib
import dataclasses
import functools
import warnings

import torch
from torch import nn

from chimera import rng
from chimera.collectives import AFTER_STEP
from chimera.check.comm_plan import Message, plan_comm
from chimera.errors import UserError
from chimera.ir import Op, Schedule, ScheduleError
from chimera.runtime.boundary import BoundarySpec, Stage, call_layer, call_loss, describe, signature
from chimera.runtime.executor import ActionRecord, Executor, MicroData
from chimera.runtime.grid import ProcessGrid
from chimera.runtime.context import ExecOptions, RunContext
from chimera.runtime.nccl_emulation import NcclEmulation, agree, emulation, p2p_transport
from chimera.runtime.p2p import Mailbox, peers_text, wait_work
from chimera.runtime.shard import StageShard
from chimera.runtime.sync import GradSync, ReplicaGrads, comm_choices, plan_collectives
from chimera.runtime.transport import ReduceOp, Transport
from chimera.sim.engine import Deadlock, simulate


class ProbeError(RuntimeError):
    """A stage failed on its probe input; raised on every rank with the same message."""


def _layers(module: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """(name, layer, spread tuples) in call order: a Stage's or Sequential's layers, else itself."""
    if isinstance(module, Stage):
        return [(n, m, True) for n, m in module.named_children()]
    if isinstance(module, nn.Sequential):
        return [(n, m, False) for n, m in module.named_children()]
    return [("0", module, False)]


@contextlib.contextmanager
def _restored(module: nn.Module, device: torch.device, waits: bool = False):
    """The probe leaves no trace: buffers (BatchNorm statistics) and the RNG come back.
    ``waits``: the stage's layers wait on other ranks (tensor parallelism), so the RNG's lock
    is held only to save and restore it (:func:`chimera.rng.kept`)."""
    saved = {k: b.detach().clone() for k, b in module.named_buffers()}
    # local work only (another virtual rank may be building), unless the layers wait
    with (rng.kept(device) if waits else rng.forked(device)):
        try:
            yield
        finally:
            with torch.no_grad():
                for k, b in saved.items():
                    module.get_buffer(k).copy_(b)


def _probe_stage(module: nn.Module, stage: int, x, last: bool, loss_fn, target, device,
                 waits: bool = False) -> tuple:
    """("ok", BoundarySpec of the output) or ("error", message naming the failing layer)."""
    with _restored(module, device, waits), torch.enable_grad():
        for name, layer, spread in _layers(module):
            try:
                x = call_layer(layer, x) if spread else layer(x)
            except Exception as exc:  # noqa: BLE001 -- reported on every rank, with its cause
                return "error", (f"stage {stage}, layer {name} ({type(layer).__name__}) failed on "
                                 f"input {describe(x)}: {type(exc).__name__}: {exc}")
        if last and target is not None:
            try:
                loss = call_loss(loss_fn, x, target)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise UserError(f"loss_fn must return a scalar tensor, got {describe(loss)}")
            except Exception as exc:  # noqa: BLE001
                return "error", (f"stage {stage}: loss_fn failed on output {describe(x)} and target "
                                 f"{describe(target)}: {type(exc).__name__}: {exc}")
        spec = BoundarySpec.of(x)
        return "ok", _sent_nowhere(spec) if last else spec


def _sent_nowhere(spec: BoundarySpec) -> BoundarySpec:
    """The last stage's output spec as it is broadcast: it reaches the loss on its own rank and
    is never sent, and an object leaf (a TP head's ``tp.ShardedLogits``, holding its group and
    so the process group) does not pickle: such a leaf is named by its type."""
    plain = (type(None), bool, int, float, str)
    leaves = tuple(leaf if leaf.shape is not None or isinstance(leaf.const, plain) else
                   dataclasses.replace(leaf, const=f"<{type(leaf.const).__name__}>")
                   for leaf in spec.leaves)
    return dataclasses.replace(spec, leaves=leaves)


def probe_boundaries(grid: ProcessGrid, modules: dict, example, transport: Transport,
                     loss_fn=None, target=None,
                     device: torch.device = torch.device("cpu")) -> list[BoundarySpec]:
    """Per stage, the BoundarySpec of its output for one micro-batch ``example``, agreed on by
    every rank; a failure raises ProbeError on every rank (not only the failing one).

    Stage s is probed by the rank holding its pipe-0 replica in data replica 0 (by all T of
    its ranks under tensor parallelism: its layers' collectives need them all), on zeros of
    the previous stage's output spec, and TP position 0 broadcasts the result. The other TP
    positions compare theirs with it for every stage but the last (the T ranks of a pipeline
    rank run one program on boundaries of one layout: a rank whose layers give another would
    send messages its peer does not expect), and one gather at the end raises the first
    disagreement on every rank.
    A real forward (with grad, to learn which outputs carry gradients) rather than the meta
    device: meta's first use imports torch's compiler stack (seconds per process).
    """
    out: list[BoundarySpec] = []
    stages, differs = grid.placement.stages, None
    for stage in range(stages):
        d = grid.placement.rank_of(0, stage)
        owner = grid.global_rank(d, 0, 0)
        box: list = [None]
        if (grid.d, grid.w) == (d, 0):
            x = example if stage == 0 else out[-1].example(device)
            box = [_probe_stage(modules[(0, stage)], stage, x, stage == stages - 1, loss_fn,
                                target, device, grid.tensor_parallel > 1)]
        mine = box[0]
        with warnings.catch_warnings():  # unpickling a TreeSpec warns about an internal isinstance
            warnings.simplefilter("ignore", FutureWarning)
            transport.broadcast_object_list(box, src=owner)
        kind, payload = box[0]
        if kind == "error":
            raise ProbeError(payload)
        # (the last stage's output goes to the loss on its own rank, sharded where the head
        # keeps its logits sharded: not a boundary)
        if mine is not None and stage < stages - 1 and mine != box[0] and differs is None:
            differs = (f"rank {grid.rank} (TP position {grid.t}): stage {stage}'s output is "
                       f"{_layout(mine[1]) if mine[0] == 'ok' else mine[1]}, at TP position 0 "
                       f"{_layout(payload)}")
        out.append(payload)
    if grid.tensor_parallel > 1:
        _agree_over_tp(transport, differs)
    return out


def _layout(spec: BoundarySpec) -> str:
    """A boundary's leaves in words: ``(2, 8, 16) float64, 3``."""
    return ", ".join(f"{leaf.shape} {str(leaf.dtype).removeprefix('torch.')}" if leaf.shape is not None
                     else repr(leaf.const) for leaf in spec.leaves)


def _agree_over_tp(transport: Transport, differs: str | None) -> None:
    """ProbeError on every rank when some TP position's probe gave another boundary than
    position 0's (``differs``: this rank's words for it, or None)."""
    every: list = [None] * transport.get_world_size()
    transport.all_gather_object(every, differs)
    first = next((e for e in every if e is not None), None)
    if first is not None:
        raise ProbeError(f"the tensor-parallel ranks of a stage disagree on its boundary: {first}; "
                         "every TP rank must build the same layers (the same plan, seed and "
                         "input shapes)")


def forward_only(schedule: Schedule) -> Schedule:
    """The forwards of a lowered schedule with their sends and receives, in the same order
    (evaluation). Dropping a rank's backward waits cannot create a cycle of waits: a forward
    depends only on the forwards before it, which keep their relative order."""
    keep = {Op.F, Op.SEND_F, Op.RECV_F, Op.STEP}
    programs = tuple(tuple(a for a in prog if a.op in keep) for prog in schedule.programs)
    out = dataclasses.replace(schedule, programs=programs)
    try:  # the argument above, checked: the simulator replays the programs' waits
        simulate(out)
    except Deadlock as exc:
        raise ScheduleError(f"the forward-only programs of {schedule.name} deadlock: {exc}") from None
    return out


class PipelineRuntime:
    """One rank's share of a pipelined model, running a lowered schedule.

    ``stage_factory(stage)`` builds stage ``stage`` (identical weights on every replica);
    ``loss_fn(output, targets)`` turns the last stage's output into a loss. ``context``: the
    run's transport, device and runtime options (:class:`~chimera.runtime.context.RunContext`);
    ``options``: how the step runs (recompute, autocast, wire dtype, sharded optimizer).
    ``rows``: rows of one schedule micro-batch; ``example`` (and ``target_example``): a
    micro-batch to fit the boundaries to now (else :meth:`prepare` before the first run).
    ``collective_stream``: the NCCL emulation's collective stream made already (by the API,
    whose tensor-parallel layers issue their collectives on it), or None: made here when the
    options ask for the emulation.
    """

    def __init__(self, schedule: Schedule, grid: ProcessGrid,
                 stage_factory: Callable[[int], nn.Module], loss_fn, context: RunContext,
                 options: ExecOptions = ExecOptions(), rows: int = 1, example=None,
                 target_example=None, collective_stream: NcclEmulation | None = None):
        if not schedule.lowered:
            raise ScheduleError("the runtime needs a lowered schedule (chimera.passes.lower)")
        self.schedule, self.grid, self.loss_fn = schedule, grid, loss_fn
        self.context, self.options = context, options
        self.transport, self.device = context.transport, context.device
        self.gathering: dict[tuple[int, int], tuple] = {}  # replica -> (all-gather work, source)
        self.rows = rows
        self.wire_dtype = options.wire_dtype  # floating boundary leaves travel in it
        grid.build_groups(self.transport)  # (done already where the stages' TP layers need it)
        self.modules, failed = self._build_stages(stage_factory)
        # options set on one rank only, or a stage one rank could not build (a plan that does
        # not fit the layers it holds), would hang its peers: refused on every rank instead
        agree(self.transport, context.options, failed)
        # the device path's choices on CUDA (or forced on CPU), alike on every rank; where a
        # replica buckets is the plan's, per stage (CommPlan.early)
        self.choices = comm_choices(self.device, self.transport.device_collectives,
                                    context.options.device_plan)
        shard = options.shard_optimizer
        multiple = {key: len(grid.stage_ranks[key[1]]) if shard else 1 for key in self.modules}
        self.grads = {key: ReplicaGrads(m, self.device, multiple[key]) for key, m in self.modules.items()}
        self.trainable = self._trainable()
        self.plan = plan_comm(schedule)
        # what each replica issues, and when (chimera.collectives: the checks read the same)
        self.collectives = plan_collectives(
            self.grads, {s: len(r) for s, r in grid.stage_ranks.items()}, self.choices,
            {(a.pipe, a.stage) for a in self.plan.early[grid.d]}, shard)
        grid.warm_up(self.plan, self.device, self.transport)
        self._equalize_replicas()
        self.shards = self._shards()
        # NCCL: no timed (CPU-blocking, polling) waits; its timeout and watchdog catch hangs
        self.timeout = context.options.comm_timeout if self.transport.timed_waits else None
        # None: no NCCL emulation; else one collective stream for the stage collectives and
        # the TP layers' (strict: the Mailboxes' p2p too)
        self.emulation = collective_stream or emulation(self.transport, context.options)
        self.sync = GradSync(self.grads, grid.stage_groups, grid.rank, self.timeout,
                             self.choices, self.emulation or self.transport, self.shards,
                             self.collectives)
        self.executor = Executor(schedule, self.modules, loss_fn, self.sync, options, self.device,
                                 early=self.plan.early[grid.d])
        self.eval_schedule = forward_only(schedule)
        self.eval_plan = plan_comm(self.eval_schedule)
        self.evaluator = Executor(self.eval_schedule, self.modules, loss_fn, self.sync,
                                  dataclasses.replace(options, recompute=False), self.device,
                                  forward_only=True)
        if self.shards:  # a replica's first forward waits for its prefetched parameters
            self.executor.before_forward = self.evaluator.before_forward = self._gathered
        self.program = self.plan.steps[grid.d]
        # per replica, where a gradient norm counts its flat buffer (set_norm_counted): all of it
        self.norm_masks: dict[tuple[int, int], torch.Tensor] = {}
        self.signature: tuple | None = None  # of the micro-batch input the boundaries fit
        self._probed: dict[tuple, tuple] = {}  # signature -> (boundaries, mailbox, eval mailbox)
        if example is not None:
            self.prepare(example, target_example)

    def _build_stages(self, stage_factory) -> tuple[dict, str | None]:
        """This rank's stage replicas, and why it could not build them (None: it could): a
        bad input raised on one rank is reported on every rank by :func:`agree`."""
        try:
            return {(p, s): stage_factory(s).to(self.device) for p, s in self.grid.held()}, None
        except UserError as exc:
            return {}, str(exc)

    def _equalize_replicas(self) -> None:
        """Every replica of a stage starts from the first group member's weights and buffers,
        as DDP does at construction: a model built from a rank's own RNG (a list made per rank
        without a shared seed, numpy or ``random`` in the builder) would otherwise train copies
        that differ while their gradients are summed. One broadcast per stage and dtype, stages
        in order on every rank (one collective order, as NCCL needs)."""
        for stage in sorted(self.grid.stage_groups):
            group = self.grid.stage_groups[stage]
            if group is None:
                continue
            module = next(m for (_, s), m in sorted(self.modules.items()) if s == stage)
            tensors = [t.data for t in list(module.parameters()) + list(module.buffers())]
            self.broadcast_flat(tensors, self.grid.stage_ranks[stage][0], group)

    def broadcast_flat(self, tensors: list[torch.Tensor], src: int, group) -> None:
        """``tensors`` take rank ``src``'s values: one broadcast per dtype of one flat buffer
        (every member passes the same list, in one order)."""
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in same])
            self.transport.broadcast(flat, src=src, group=group)
            torch._foreach_copy_(same, [v.view_as(t) for v, t in
                                        zip(flat.split([t.numel() for t in same]), same)])

    def _shards(self) -> dict:
        """ZeRO-1 (chimera.runtime.shard): this rank's slice of each replica whose collectives
        gather parameters after the step (sharded, with a group and something to train: a
        frozen stage is frozen on every replica, none has a shard)."""
        out = {}
        for key, g in self.grads.items():
            group = self.grid.stage_groups.get(key[1])
            if any(c.when == AFTER_STEP for c in self.collectives[key]):
                out[key] = StageShard.build(g.params, g.offsets, g.flat.numel(),
                                            self.grid.stage_ranks[key[1]], self.grid.rank, group,
                                            self.choices.reduce_scatter, self.transport)
        return out

    def optimizer_parameters(self) -> list[tuple[torch.Tensor, bool]]:
        """(tensor the optimizer updates, whether it is a matrix) for this rank: the pieces of
        its slices where the optimizer is sharded, the whole parameters elsewhere."""
        out = []
        for key, g in sorted(self.grads.items()):
            shard = self.shards.get(key)
            if shard is None:
                out += [(p, p.dim() >= 2) for p in g.params]
            else:
                out += [(pc.piece, pc.param.dim() >= 2) for pc in shard.pieces]
        return out

    def gather_gradients(self) -> None:
        """Sharded: every replica's ``.grad`` gets the group's summed gradient everywhere, not
        only in its slice, as unsharded training leaves it (for inspection; collective)."""
        for key in sorted(self.shards, key=lambda k: (k[1], k[0])):
            shard, flat = self.shards[key], self.grads[key].flat
            flat[shard.lo:shard.hi].copy_(shard.grad)
            shard.all_gather(flat)

    def gather_parameters(self) -> None:
        """After the optimizer step: every replica gets every slice. The all-gathers are issued
        now, stages in order on every rank (one collective order, as NCCL needs), and each is
        waited for right before its replica's first forward (prefetch: a rank's later stages
        gather while its first ones compute) or any read of the parameters
        (:meth:`finish_gather`)."""
        self.finish_gather()  # a replica that ran no forward since the last step
        for key in sorted(self.shards, key=lambda k: (k[1], k[0])):
            self.gathering[key] = self.shards[key].all_gather_async(self.sync.transport)

    def _gathered(self, key: tuple[int, int]) -> None:
        if key in self.gathering:
            self.finish_gather(key)

    def finish_gather(self, key: tuple[int, int] | None = None) -> None:
        """Wait for the parameter all-gather of replica ``key`` (default: every replica)."""
        keys = list(self.gathering) if key is None else [key]
        for k in keys:
            pending = self.gathering.pop(k, None)
            if pending is not None:
                ranks = self.grid.stage_ranks[k[1]]
                wait_work(pending[0], self.sync.timeout, self.grid.rank,
                          f"parameter all-gather of stage {k[1]} (pipe {k[0]}) with "
                          f"{peers_text(self.grid.rank, ranks)}", ranks)

    KEEP_SHAPES = 4  # boundary layouts (and their receive buffers) kept for alternating shapes

    def prepare(self, example, target=None) -> None:
        """Fit the boundaries to a micro-batch input like ``example`` (a pytree of ``rows``
        rows): probe and allocate again when its structure, shapes or dtypes changed, so a
        stage never runs on buffers sized for another shape. Every rank calls it with the
        same signature (it probes with collectives)."""
        sig = signature(example)
        if sig == self.signature:
            return
        if sig not in self._probed:
            bounds = [dataclasses.replace(b, wire=self.wire_dtype) for b in probe_boundaries(
                self.grid, self.modules, example, self.transport, self.loss_fn, target,
                self.device)]
            if len(self._probed) >= self.KEEP_SHAPES:
                self._probed.pop(next(iter(self._probed)))
            self._probed[sig] = (bounds, self._mailbox(self.plan, bounds), None)
        self.signature = sig
        self.shapes = self._probed[sig][0]
        self.executor.boundaries, self.executor.mailbox = self._probed[sig][:2]

    def _mailbox(self, plan, bounds: list) -> Mailbox:
        # the strictest emulation runs every operation of the rank on one stream: p2p too
        strict = self.context.options.strict
        transport = self.emulation if strict else p2p_transport(self.transport, self.context.options)
        return Mailbox(plan, self.grid, functools.partial(self._message_shape, bounds),
                       torch.uint8, self.device, self.timeout, transport)

    def message_shape(self, msg: Message) -> tuple:
        """The shape (bytes) ``msg`` has on the wire at the boundaries :meth:`prepare` fitted."""
        return self._message_shape(self.shapes, msg)

    @staticmethod
    def _message_shape(bounds: list, msg: Message) -> tuple:
        # an activation is its sender's output; a gradient into stage s is s's output's
        if msg.kind.name == "RECV_F":
            return (bounds[msg.source_stage].nbytes(backward=False),)
        return (bounds[msg.stage].nbytes(backward=True),)

    def all_reduce(self, tensor: torch.Tensor, group=None, op=None) -> None:
        """A blocking allreduce outside the schedule (tie and buffer syncs, the API's loss):
        under the strict NCCL emulation on the rank's one stream, so it takes its place in
        the rank's order as on NCCL; else the transport's."""
        ranks = self.transport.get_process_group_ranks(group) if group is not None else \
            list(range(self.transport.get_world_size()))
        wait_work(self.all_reduce_async(tensor, group, op), self.sync.timeout, self.grid.rank,
                  f"allreduce with {peers_text(self.grid.rank, ranks)}", ranks)

    def all_reduce_async(self, tensor: torch.Tensor, group=None, op=None):
        """The same allreduce started, its work returned (the API's batch fingerprint: issued
        when a step starts, read before it returns)."""
        op = ReduceOp.SUM if op is None else op
        strict = self.context.options.strict
        return (self.emulation if strict else self.transport).all_reduce(
            tensor, op=op, group=group, async_op=True)

    def parameters(self) -> list[nn.Parameter]:
        self.finish_gather()
        return [p for m in self.modules.values() for p in m.parameters()]

    def _trainable(self) -> tuple:  # (reads no values: needs no pending all-gather)
        return tuple(p.requires_grad for m in self.modules.values() for p in m.parameters())

    def zero_grad(self, keep: bool = False) -> None:
        """Point every ``.grad`` back at its flat buffer (``zero_grad(set_to_none=True)`` or an
        assignment detached it) and zero the buffers unless ``keep``."""
        for g in self.grads.values():
            g.attach(keep)
        for shard in self.shards.values():  # the optimizer's pieces (their sums: overwritten)
            shard.attach(keep)

    def grad_tensors(self) -> list[torch.Tensor]:
        """Per replica, the tensor that holds its synchronized gradient after :meth:`run`:
        the owned slice where the optimizer is sharded, the whole flat buffer elsewhere."""
        return [self.shards[k].grad if k in self.shards else g.flat
                for k, g in sorted(self.grads.items())]

    def run(self, data: MicroData, record: list[ActionRecord] | None = None) -> torch.Tensor:
        """One iteration's forwards, backwards and gradient sync (not the optimizer step);
        returns this rank's share of the loss as a device scalar."""
        if self.executor.mailbox is None:
            raise RuntimeError("PipelineRuntime.prepare(example) must run before the first step")
        if self._trainable() != self.trainable:
            raise RuntimeError(
                "requires_grad of a parameter changed after the pipeline was built (gradual "
                "unfreezing): its gradient buffers, allreduce and boundaries were sized for the "
                "old set; build the pipeline again after changing which parameters train")
        return self.executor.run(self.program, data, record)

    def run_forward(self, data: MicroData) -> torch.Tensor:
        """Forwards only (no graph, no gradient, no sync); ``data.outputs`` collects outputs."""
        bounds, box, eval_box = self._probed[self.signature]
        if eval_box is None:
            eval_box = self._mailbox(self.eval_plan, bounds)
            self._probed[self.signature] = (bounds, box, eval_box)
        self.evaluator.boundaries, self.evaluator.mailbox = bounds, eval_box
        with torch.no_grad():
            return self.evaluator.run(self.eval_plan.steps[self.grid.d], data)

    def set_norm_counted(self, counted) -> None:
        """``counted(param) -> bool``: whether this rank counts a parameter's gradient in the
        global norm (tensor parallelism: a replicated parameter on one TP position only, a
        shard on every one); the rest of the flat buffer counts zero in :meth:`owned_sq_norm`."""
        self.norm_masks = {}
        for key, g in self.grads.items():
            flags = [bool(counted(p)) for p in g.params]
            if all(flags):
                continue
            mask = torch.ones_like(g.flat)
            for p, off, keep in zip(g.params, g.offsets, flags):
                if not keep:
                    mask[off:off + p.numel()] = 0
            self.norm_masks[key] = mask

    def owned_sq_norm(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (float64 scalar).

        After the allreduce every replica of a stage holds the same gradient, so each of the
        stage's replica ranks sums the squares of one slice of it: the stage counts once, and
        the work is spread evenly (a norm in the parameters' own precision is ~40x faster than
        converting to float64 first; the partial sums are added in float64).
        """
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for (p, s), g in self.grads.items():
            mask = self.norm_masks.get((p, s))
            if min(q for q, t in self.grads if t == s) != p:
                continue  # a second replica of the same stage on this rank
            ranks = self.grid.stage_ranks[s]
            k, n = ranks.index(self.grid.rank), len(ranks)
            size = -(-g.flat.numel() // n)
            shard = self.shards.get((p, s))  # sharded: only the owned slice was reduced
            lo, hi = (shard.lo, shard.hi) if shard is not None else (k * size, (k + 1) * size)
            part = shard.grad if shard is not None else g.flat[lo:hi]
            if mask is not None:  # replicated over TP: counted at t = 0 only
                part = part * mask[lo:hi]
            if part.numel():
                total += torch.linalg.vector_norm(part).double() ** 2
        return total
