"""Run benchmark rows interleaved in time, in one group of spawned gloo processes.

Every row's runtime is built once in one spawned group of D ranks (W*D with
``--data-parallel W``: W copies of each row's pipeline); then each round runs one
full optimizer step of every row (A B C A B C ...; each round starts one row later), so slow
drift of a shared, noisy machine hits all rows alike. Every rank starts a step at the same
instant (:func:`start_together`: one clock on one machine) and times it from there to its end;
the row's time is the slowest rank's. Rows of one process run on rank 0
while the others wait at the next barrier (blocked, not spinning). Peak activations come
from one more, instrumented step per row; peak RSS from a fresh process group per row (a
process's high-water mark cannot be split between rows that share it).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time

import torch

from chimera.bench import emulated
from chimera.models.emulated import tighten_timer_slack
from chimera.bench.rows import BenchConfig, Row
from chimera.bench.start import bench_context, start_together
from chimera.bench.runners import OursRunner, SingleRunner, peak_activation_bytes
from chimera.bench.torchpp import TorchRunner
from chimera.runtime import workers
from chimera.runtime.allocator import keep_freed_memory
from chimera.runtime.context import RunContext
from chimera.runtime.transport import ReduceOp, Transport
from chimera.runtime.workers import gloo_group


FAILURE_GRACE_S = 10.0  # after one rank fails, how long the others get to say why


def make_runner(cfg: BenchConfig, row: Row, context: RunContext):
    """``row``'s runner on this rank, in the rank's ``context``."""
    if cfg.emulate:
        kind = {"chimera": emulated.EmulatedOurs, "floor": emulated.EmulatedFloor}
        return kind.get(row.impl, emulated.EmulatedTorch)(cfg, row, context)
    if row.impl == "single":
        return SingleRunner(cfg, row, context)
    if row.impl == "chimera":
        return OursRunner(cfg, row, context)
    return TorchRunner(cfg, row, context)


def _group(rank: int, world: int, port: int, cfg: BenchConfig, context: RunContext):
    """The rank's gloo group (``context.transport``'s), the process set up as ``context`` says."""
    keep_freed_memory(context.options.malloc)  # as `chimera train`: every row, torch's too
    if cfg.emulate:  # before gloo starts its threads, which inherit it
        tighten_timer_slack()
    return gloo_group(rank, world, port, cfg.threads, cfg.comm_timeout)


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, file=sys.stderr, flush=True)


def _build(cfg: BenchConfig, rows: list[Row], context: RunContext) -> tuple[list, dict[str, str]]:
    """Runners of every row, in the same order on every rank; rows that fail are skipped."""
    runners, failed = [], {}
    for row in rows:
        try:
            runners.append(make_runner(cfg, row, context))
        except Exception as exc:  # a scheme that cannot run this layout: report, go on
            runners.append(None)
            failed[row.id] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    for other in _from_every_rank(context.transport, failed):
        failed.update(other)
    return [None if row.id in failed else r for row, r in zip(rows, runners)], failed


def _rounds(cfg: BenchConfig, rows: list[Row], runners: list,
            transport: Transport) -> tuple[list, list]:
    """Step times of every row and round, and each row's loss of the first step (rank 0's)."""
    rank = transport.get_rank()
    live = [k for k, r in enumerate(runners) if r is not None]
    times: list[list[float]] = [[] for _ in rows]
    losses: list[float | None] = [None] * len(rows)
    for rnd in range(cfg.rounds):
        start = time.perf_counter()
        for j in range(len(live)):
            k = live[(rnd + j) % len(live)]
            t0 = start_together(transport)
            loss = runners[k].step(rnd)
            times[k].append(time.perf_counter() - t0)
            if rnd == 0:
                losses[k] = loss
        what = "warm-up" if rnd < cfg.warmup else "measured"
        _say(rank, f"bench: round {rnd + 1}/{cfg.rounds} ({what}) {time.perf_counter() - start:.1f} s")
    return times, losses


def _slowest(transport: Transport, values: list[list[float]]) -> list[list[float]]:
    """Element-wise maximum over ranks (rows of different lengths are padded with zeros)."""
    width = max((len(v) for v in values), default=0)
    t = torch.tensor([v + [0.0] * (width - len(v)) for v in values], dtype=torch.float64)
    transport.all_reduce(t, op=ReduceOp.MAX)
    return [t[k, :len(v)].tolist() for k, v in enumerate(values)]


def _activations(cfg: BenchConfig, runners: list, transport: Transport) -> list[float | None]:
    peaks = []
    for r in runners:
        transport.barrier()
        peaks.append(None if r is None else peak_activation_bytes(r, cfg.rounds) / 2**20)
    merged = _slowest(transport, [[p or 0.0] for p in peaks])
    return [None if r is None else m[0] for r, m in zip(runners, merged)]


def _timing_worker(rank: int, world: int, port: int, cfg: BenchConfig, rows: list[Row],
                   out: str) -> None:
    context = bench_context(cfg.comm_timeout)
    with _group(rank, world, port, cfg, context):
        transport = context.transport
        latency = emulated.link_latency(cfg, transport) if cfg.emulate else None
        _say(rank, f"bench: building {len(rows)} rows on {world} ranks")
        runners, failed = _build(cfg, rows, context)
        for row_id, why in failed.items():
            _say(rank, f"bench: skipping {row_id}: {why}")
        times, losses = _rounds(cfg, rows, runners, transport)
        times = _slowest(transport, times)
        extra = _emulated_extras(cfg, runners, transport) if cfg.emulate else {}
        acts = _activations(cfg, runners, transport) if not cfg.emulate else \
            [None if p is None else max(p) / 2**20 for p in extra["activation_bytes"]]
        if rank == 0:  # every row trains the same model on the same data: same first loss
            with open(out, "w") as f:
                json.dump({"times": times, "activation_mb": acts, "failed": failed,
                           "first_loss": losses, "latency": latency, **extra}, f)


def _from_every_rank(transport: Transport, value) -> list:
    everyone: list = [None] * transport.get_world_size()
    transport.all_gather_object(everyone, value)
    return everyone


def _emulated_extras(cfg: BenchConfig, runners: list, transport: Transport) -> dict:
    """Per row: peak activation bytes of every rank, the order that ran (ours: the lowered
    schedule; torch's: its pipeline_order), one traced step's waits on every rank, and every
    rank's wait totals (asked and taken, per kind, over all its steps)."""
    peaks, orders, traces, totals = [], [], [], []
    for k, r in enumerate(runners):
        transport.barrier()
        keeps = r is not None and not isinstance(r, emulated.EmulatedFloor)  # a floor keeps none
        peak = peak_activation_bytes(r, cfg.rounds + 1) if keeps else 0
        peaks.append(_from_every_rank(transport, peak) if keeps else None)
        order = None if r is None else r.order()
        orders.append(None if order is None else order.to_json())
        waits = None if r is None else emulated.traced_step(r, cfg.rounds + 2)
        traces.append(None if r is None else _from_every_rank(transport, waits))
        totals.append(None if r is None else _from_every_rank(transport, r.log.totals))
    return {"activation_bytes": peaks, "orders": orders, "traces": traces, "wait_totals": totals}


def _memory_worker(rank: int, world: int, port: int, cfg: BenchConfig, row: Row, out: str) -> None:
    context = bench_context(cfg.comm_timeout)
    with _group(rank, world, port, cfg, context):
        runner = make_runner(cfg, row, context)
        for i in range(2):
            context.transport.barrier()
            runner.step(i)
        peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
        context.transport.all_reduce(peak, op=ReduceOp.MAX)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"peak_rss_mb": float(peak)}, f)


def _spawn(fn, world: int, args: tuple) -> None:
    """``fn(rank, world, store, *args)`` on ``world`` ranks (``store``: the port of the store
    hosted here, for ``gloo_group``)."""
    with workers.hosted_store(world) as store:
        codes = workers.run(fn, (world, store, *args), world, grace=FAILURE_GRACE_S)
    if workers.cause(codes) is not None:
        raise RuntimeError(f"{workers.summary(codes)} (the ranks' messages are above)")


def measure_memory(cfg: BenchConfig, row: Row, tmp: str) -> float | None:
    """Peak RSS (MB, the largest over ranks) of a fresh process group running only ``row``."""
    out = os.path.join(tmp, "memory.json")
    world = 1 if row.impl == "single" else cfg.world
    try:
        _spawn(_memory_worker, world, (cfg, row, out))
        with open(out) as f:
            return json.load(f)["peak_rss_mb"]
    except Exception as exc:  # memory is a side figure: never lose the timings for it
        print(f"bench: peak RSS of {row.id} not measured: {exc}", file=sys.stderr)
    return None


def measure(cfg: BenchConfig, rows: list[Row]) -> dict:
    """Raw measurements: per row step times (every round), peak activation and RSS (MB)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "timing.json")
        _spawn(_timing_worker, cfg.world, (cfg, rows, out))
        with open(out) as f:
            raw = json.load(f)
        raw["rss_mb"] = [None] * len(rows)
        if cfg.memory:
            for k, row in enumerate(rows):
                if row.id not in raw["failed"]:
                    print(f"bench: peak RSS of {row.id} (fresh processes)", file=sys.stderr, flush=True)
                    raw["rss_mb"][k] = measure_memory(cfg, row, tmp)
    return raw
