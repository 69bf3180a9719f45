"""Benchmark rows on accelerator-like stages (``chimera bench --emulate F:I:W``).

Every row runs the same emulated model (:mod:`chimera.models.emulated`: layers that wait for
their compute, as a host waits for a GPU, and carry small real tensors): ours through the
library's front door (:class:`chimera.api.Pipeline`), torch's through
``torch.distributed.pipelining`` with the same layers, cut and data. A step is one
mini-batch's forwards, backwards and gradient sync (no optimizer step: the simulated time it
is compared with prices none). Each row is also simulated (:func:`simulated`) at the same
costs: ours from the lowered schedule the runtime runs, torch's from the order its schedule
object executes (``pipeline_order``), so realized / simulated is the runtime's own cost.

Floor rows (:class:`EmulatedFloor`) run each of our schedules through the same runtime
(``PipelineRuntime``: the CommPlan, Executor, Mailbox and GradSync our rows use; no second
interpreter of a rank's program) on null-compute stages: one layer per stage that waits once
per action, exactly its simulated cost, keeps no activation and computes only what the
boundaries need (its input plus a bias), so that it sends and reduces the bytes ours does.
So the floor holds the machine (sleeping, waking, gloo: D ranks on its cores) and, since the
runtime runs it, the executor's own host code per action (its handlers, boundary packing and
unpacking, the autograd engine's calls on a one-layer stage, the loss, the mailbox and
gradient sync calls). Floor / simulated is the machine and the executor; ours / floor
isolates the model-side host work around them: the API's step (splitting the mini-batch, the
batch check, the loss allreduce and read), the model's own layers (two a stage where D stages
cut it: twice the waits, wake-ups and autograd nodes) and the activations they keep. (Until
issue 34 the floor walked the CommPlan's steps itself with bare waits, the executor's code in
ours alone: figures measured then are not comparable with these.)
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import torch
from torch import nn
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from chimera.api import ExecOptions, ModelOptions, Pipeline
from chimera.bench import prices
from chimera.bench.links import LateSends, PricedTransport, late_torch_sends
from chimera.bench.prices import layer_count, layer_weights, stage_costs  # noqa: F401 (re-exported)
from chimera.bench.rows import BenchConfig, Row
from chimera.bench.profiler import allreduce_time, ping
from chimera.bench.start import start_together
from chimera.bench.torch_dp import StageReduction, copy_groups
from chimera.bench.torch_orders import from_pipeline_order, torch_placement
from chimera.bench.torchpp import TorchPipeline
from chimera.ir import Schedule
from chimera.models.emulated import (EmulatedCost, WaitLog, emulated_batch, emulated_layers,
                                     emulated_pieces)
from chimera.passes import lower
from chimera.runtime.context import RunContext
from chimera.runtime.transport import ReduceOp, Transport
from chimera.schedules import build, get_scheme
from chimera.sim import simulate

def cost_of(cfg: BenchConfig) -> EmulatedCost:
    return EmulatedCost.parse(cfg.emulate, rows=cfg.micro_batch_size, width=prices.WIDTH,
                              activation_bytes=int(cfg.activation_mb * 2**20), spin=cfg.spin)


def our_schedule(cfg: BenchConfig, row: Row) -> Schedule:
    """The row's schedule; where the bench prices more than uniform stages, a scheme that is
    ordered by costs (chimera-zb) is told the bench's (:func:`chimera.bench.prices.cost_model`)."""
    opts = row.scheme_options
    plan = build(row.schedule, cfg.stages, cfg.micro_batches, **opts)
    if not prices.priced(cfg) or "cost" not in get_scheme(row.schedule).options or "cost" in opts:
        return plan
    c = cost_of(cfg)  # compute, the link and the collectives (the measured links come later)
    told = prices.cost_model(cfg, plan, c.forward_s, c.input_grad_s, c.weight_grad_s,
                             sharded=is_sharded(row))
    return build(row.schedule, cfg.stages, cfg.micro_batches, **opts, cost=told)


def is_sharded(row: Row) -> bool:
    return bool(row.opts.get("shard"))


_SENDS: dict[float, LateSends] = {}  # one late-send thread per link time in this process


def late_sends(cfg: BenchConfig) -> LateSends | None:
    if not cfg.link_ms:
        return None
    return _SENDS.setdefault(cfg.link_ms, LateSends(cfg.link_ms / 1e3))


def priced_context(cfg: BenchConfig, context: RunContext) -> RunContext:
    """``context`` whose transport delivers each send ``link_ms`` late and prices the
    gradient allreduce of a D-th (``layers_per_stage`` layers of ``WIDTH`` floats) at
    ``allreduce_ms`` (:mod:`chimera.bench.links`); as it is where neither is asked."""
    if not (cfg.link_ms or cfg.allreduce_ms):
        return context
    per_float = cfg.allreduce_ms / 1e3 / (cfg.layers_per_stage * prices.WIDTH)
    transport = PricedTransport(context.transport, late_sends(cfg), per_float)
    return dataclasses.replace(context, transport=transport)


def _device_path(context: RunContext) -> RunContext:
    """``context`` taking the device path's collective choices (``device_plan``): a sharded
    replica reduces by reduce-scatter, as on GPUs, where the CPU path allreduces (gloo's
    reduce-scatter is slower), which the bench would price as a whole allreduce."""
    return context.replace(options=dataclasses.replace(context.options, device_plan=1))


class EmulatedOurs:
    """Our runtime on emulated stages, through ``chimera.api.Pipeline``, in ``context`` (the
    bench rank's: ``start.bench_context``)."""

    def __init__(self, cfg: BenchConfig, row: Row, context: RunContext):
        self.cfg, self.cost, self.log = cfg, cost_of(cfg), WaitLog()
        layers, plan = layer_count(cfg), our_schedule(cfg, row)
        self.pipe = Pipeline(
            emulated_layers(self.cost, cfg.stages, layers, cfg.seed, self.log, layer_weights(cfg),
                            prices.extra_params(cfg)),
            nn.functional.mse_loss, schedule=plan,
            micro_batches=cfg.micro_batches, micro_batch_size=cfg.micro_batch_size,
            data_parallel=cfg.data_parallel,
            model=ModelOptions(num_layers=layers,
                               partition=prices.cut(cfg, plan.placement, plan.micro_pipe)),
            options=ExecOptions(schedule_options=row.scheme_options,
                                shard_optimizer=is_sharded(row)),
            context=priced_context(cfg, _device_path(context) if is_sharded(row) else context))
        self.transport = context.transport
        self.schedule = self.pipe.schedule
        self.params = self.pipe.parameters()

    def step(self, i: int) -> float:
        x, y = emulated_batch(self.cost, self.cfg.global_batch, i, self.cfg.seed)
        return self.pipe.step(x, y)

    def order(self) -> Schedule:
        return self.schedule


class EmulatedFloor:
    """The floor under our rows (see the module's docstring for what it holds): the row's
    schedule in a :class:`chimera.api.Pipeline` whose stages are one fused emulated layer
    each (:func:`chimera.models.emulated.emulated_stages`; no activation kept). A step is the
    runtime's own iteration, ``zero_grad`` and ``run`` on the micro-batch split made when
    the row was built, not the API's step."""

    def __init__(self, cfg: BenchConfig, row: Row, context: RunContext):
        self.cfg, self.log, self.transport = cfg, WaitLog(), context.transport
        cost = dataclasses.replace(cost_of(cfg), activation_bytes=0)  # null compute keeps none
        plan = our_schedule(cfg, row)
        ranges = prices.cut(cfg, plan.placement, plan.micro_pipe)
        self.pipe = Pipeline(
            emulated_pieces(cost, ranges, layer_weights(cfg), cfg.seed, self.log,
                            prices.extra_params(cfg)),
            nn.functional.mse_loss, schedule=plan, micro_batches=cfg.micro_batches,
            micro_batch_size=cfg.micro_batch_size, data_parallel=cfg.data_parallel,
            model=ModelOptions(num_layers=plan.stages),
            options=ExecOptions(check_batch=False), context=priced_context(cfg, context))
        self.runtime, self.schedule = self.pipe.runtime, self.pipe.schedule
        self.params = self.pipe.parameters()
        # one API step fits the boundaries and allocates the mailbox (every rank builds its
        # rows in one order, so its collectives meet): so every timed step is a floor step,
        # and its loss, that of our row's first step, says the floor computes our model
        x, y = emulated_batch(cost, cfg.global_batch, 0, cfg.seed)
        self.loss: float | None = self.pipe.step(x, y)
        self.data, _ = self.pipe._micro_data(x, y, 1.0)  # the API's own split, made once

    def step(self, i: int) -> float | None:
        self.runtime.zero_grad()
        self.runtime.run(self.data)
        loss, self.loss = self.loss, None  # a floor step reads no loss: the build's step had one
        return loss

    def order(self) -> Schedule:
        return self.schedule


class EmulatedTorch(TorchPipeline):
    """``torch.distributed.pipelining`` on the same emulated layers, cut and data; with
    ``data_parallel`` W, W copies of the pipeline, each stage's gradients reduced over the
    copies at torch's REDUCE_GRAD (:mod:`chimera.bench.torch_dp`), priced as ours."""

    def __init__(self, cfg: BenchConfig, row: Row, context: RunContext):
        self.cost, self.log = cost_of(cfg), WaitLog()
        make = emulated_layers(self.cost, cfg.stages, layer_count(cfg), cfg.seed, self.log,
                               layer_weights(cfg), prices.extra_params(cfg))
        placement = torch_placement(row.schedule, cfg.stages)

        def module_of(stage: int, n: int) -> nn.Module:
            ranges = prices.cut(cfg, placement, (0,) * cfg.micro_batches)
            return nn.Sequential(*[make(i) for i in ranges[stage]])
        copy, pipes, dp = context.rank // cfg.stages, [None], None
        if cfg.data_parallel > 1:
            pipes, dp = copy_groups(context.transport, cfg.stages, cfg.data_parallel)
        super().__init__(cfg, row, context, module_of, nn.functional.mse_loss, pipes[copy])
        if dp is not None:
            self.reduction = StageReduction(self.stage_objects, dp[context.rank % cfg.stages],
                                            priced_context(cfg, context).transport,
                                            cfg.data_parallel, is_sharded(row))
        self.rows = slice(copy * cfg.global_batch // cfg.data_parallel,
                          (copy + 1) * cfg.global_batch // cfg.data_parallel)

    def step(self, i: int) -> float:
        x, y = emulated_batch(self.cost, self.cfg.global_batch, i, self.cfg.seed)
        for p in self.params:
            p.grad = None
        if self.reduction is not None:
            self.reduction.gather()  # sharded: every stage's parameters, before its first forward
        with late_torch_sends(late_sends(self.cfg)):
            return self.run(x[self.rows], y[self.rows])

    def order(self) -> Schedule | None:
        """The order torch's schedule object executes, as our (unlowered) Schedule: a
        multi-stage schedule runs its ``pipeline_order``; a single-stage one (GPipe, 1F1B)
        runs its own loop, the textbook order our schedule of the same name has (its
        ``pipeline_order`` is for pictures only: torch 2.13's 1F1B one numbers rank 1's
        forwards from 1)."""
        if isinstance(self.schedule, PipelineScheduleSingle):
            return build(self.row.schedule, self.cfg.stages, self.cfg.micro_batches)
        order = getattr(self.schedule, "pipeline_order", None)
        if not order:
            return None
        return from_pipeline_order(self.row.schedule, type(self.schedule).__name__,
                                   self.cfg.stages, self.cfg.micro_batches, order)


# -- measured link latencies ------------------------------------------------------------------
def link_latency(cfg: BenchConfig, transport: Transport, reps: int = 30) -> dict:
    """Median one-way p2p time of one boundary message between ranks 0 and 1 (half a
    ping-pong round trip) and median allreduce time of one stage's gradient between ranks 0
    and D-1 (Chimera's stage-0 pair), over gloo, measured in the bench's own process group
    (``transport``)."""
    width, rows = cost_of(cfg).width, cfg.micro_batch_size
    msg, grad = torch.zeros(rows, width), torch.zeros(width * 2)
    ends = (0, cfg.stages - 1)
    pair = transport.new_group(list(ends))
    trips = [ping(transport, msg) for _ in range(reps + 3)][3:]
    reduces = [allreduce_time(transport, grad, pair, ends) for _ in range(reps + 3)][3:]
    # ranks outside a pair timed nothing (0): the pair's own medians win the MAX
    box = torch.tensor([statistics.median(trips), statistics.median(reduces)], dtype=torch.float64)
    transport.all_reduce(box, op=ReduceOp.MAX)
    return {"p2p_s": float(box[0]), "allreduce_s": float(box[1]),
            "how": f"p2p: median of {reps} half round trips of a {rows}x{width} float32 message "
                   f"between ranks 0 and 1; allreduce: median of {reps} allreduces of "
                   f"{2 * width} floats between ranks 0 and {cfg.stages - 1}; gloo, in the "
                   "bench's process group, before the rows run"}


# -- simulation --------------------------------------------------------------------------------
def simulated(schedule: Schedule, cfg: BenchConfig, latency: dict | None,
              stretch: dict[str, float] | None = None, sharded: bool = False) -> dict:
    """Step time of ``schedule`` at the emulated costs: with the measured p2p and allreduce
    times, and with free communication (the schedule's own makespan); peak activations per
    rank (in Ma) from the same simulation. With ``stretch`` (per op kind F/I/W, how much
    longer the waits actually took than asked, from a traced step), also the step at those
    measured compute times: realized over it is the runtime's own cost alone, without the
    emulator's sleep overshoot. ``sharded``: the row's optimizer is sharded (ZeRO-1)."""
    cost = cost_of(cfg)
    lowered = schedule if schedule.lowered else lower(schedule, "eager")
    times = dict(f=cost.forward_s, i=cost.input_grad_s, w=cost.weight_grad_s)
    free = simulate(lowered, prices.cost_model(cfg, lowered, **times, free=True))
    out = {"simulated_free_s": free.makespan,
           "simulated_peak_activations": [r.peak_activations for r in free.ranks]}
    if latency is None:
        return out
    links = dict(p2p_s=latency["p2p_s"], allreduce_s=latency["allreduce_s"], sharded=sharded)
    timed = simulate(lowered, prices.cost_model(cfg, lowered, **times, **links))
    out["simulated_step_s"], out["timeline"] = timed.makespan, timed
    if stretch:
        at = {k: v * stretch.get(k.upper(), 1.0) for k, v in times.items()}
        out["simulated_measured_waits_s"] = simulate(
            lowered, prices.cost_model(cfg, lowered, **at, **links)).makespan
    return out


def stretch_of(totals: list[dict] | None) -> dict[str, float] | None:
    """Per op kind (F, I, W): seconds the waits took / seconds asked, over every rank's
    steps (``WaitLog.totals`` of each rank)."""
    if not totals:
        return None
    took: dict[str, list[float]] = {}
    for rank_totals in totals:
        for kind, (t, asked) in rank_totals.items():
            acc = took.setdefault(kind, [0.0, 0.0])
            acc[0] += t
            acc[1] += asked
    return {k: a / b for k, (a, b) in sorted(took.items()) if b > 0}


# -- traces ------------------------------------------------------------------------------------
def trace_events(waits: list[list[tuple]], timeline, starts: list[float]) -> dict:
    """One Perfetto file: per rank the waits a runtime actually ran (measured, from the
    layers' WaitLog; a stage's layers show one slice each) and the simulated actions of the
    same schedule below it, both from the step's start (``perf_counter`` is the system's
    monotonic clock, one time axis for every process on a machine)."""
    events = []
    base = min(starts)
    ranks = len(waits)
    for r in range(ranks):
        events += [_meta(r, f"rank {r} measured"), _meta(1000 + r, f"rank {r} simulated")]
        for label, start, end, _ in waits[r]:
            events.append({"name": label, "ph": "X", "pid": r, "tid": 0,
                           "ts": (start - base) * 1e6, "dur": (end - start) * 1e6})
    if timeline is not None:
        for e in timeline.events:
            if e.action.op.is_compute:
                events.append({"name": str(e.action), "ph": "X", "pid": 1000 + e.rank, "tid": 0,
                               "ts": e.start * 1e6, "dur": e.duration * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _meta(pid: int, name: str) -> dict:
    return {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}


def is_emulated(runner) -> bool:
    return isinstance(runner, (EmulatedOurs, EmulatedTorch, EmulatedFloor))


def traced_step(runner, i: int) -> tuple[list[tuple], float]:
    """One more step of ``runner`` with its layers' waits logged; (waits, step start)."""
    runner.log.events.clear()
    runner.log.on = True
    start = start_together(runner.transport)
    try:
        runner.step(i)
    finally:
        runner.log.on = False
    return list(runner.log.events), start


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b or math.isnan(a) or math.isnan(b) else a / b


__all__ = ["EmulatedFloor", "EmulatedOurs", "EmulatedTorch", "cost_of", "link_latency", "simulated",
           "trace_events", "traced_step"]
