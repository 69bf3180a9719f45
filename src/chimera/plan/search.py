"""Enumerate (scheme, W, D, T, B, N, recompute), price each with the simulator, keep the best.

The search is exact branch and bound, not sampling: every configuration is enumerated and
gets lower bounds on its time (``chimera.theory.bounds``) and memory (``workload.memory_floor``)
that need no simulation; it is simulated only if those say it could still enter the top K or
beat the best of its scheme. It goes best-first on the sharp bound, which is computed lazily in order of a cheap one, so good
configurations are found early and most of the rest are cut. Schedules are generated once per
shape (``shapes``) and timed for each cost model in one pass (``sim.engine``).

Tensor parallelism is one more axis: for each T the workload allows, W * D = P / T; a
candidate's stage costs, memory and bounds are one TP rank's (``workload``, ``tensor``), so the
bounds stay below what the simulator gives for the same T.

Where it approximates: nowhere in the search; the approximations are the cost model's
(``workload``, ``hardware``, ``memory``, ``tensor``) and the asynchronous schemes' steady state
(``chimera.theory.bounds.async_parts``).
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
import math
import time
from dataclasses import dataclass, replace

from chimera.theory import bounds
from chimera.ir import Op, OpTimes, ScheduleError
from chimera.plan.hardware import PlanError
from chimera.plan.memory import state_bytes
from chimera.plan.shapes import Shape, ShapeCache, is_reference
from chimera.plan.workload import Pricing, StageCosts, Workload, divisors, memory_floor
from chimera.schedules import build, get_scheme, schemes
from chimera.schedules.asynchronous import weight_versions


@dataclass(frozen=True, order=True)
class Candidate:
    scheme: str
    options: tuple[tuple[str, object], ...]
    depth: int  # D: ranks per pipeline
    width: int  # W: data-parallel copies
    micro_batch: int  # B: sequences per micro-batch
    micro_batches: int  # N: micro-batches per pipeline per iteration
    recompute: bool
    shard: bool = False  # optimizer sharded over each stage's replica group (ZeRO-1)
    tensor: int = 1  # T: tensor-parallel ranks per pipeline rank (P = W * D * T)

    @property
    def variant(self) -> str:
        """The scheme with its options, e.g. ``chimera Q=2 direct`` (``+zero1`` if sharded)."""
        if is_reference(self.scheme):
            return self.scheme
        return get_scheme(self.scheme).label(self.options) + (" +zero1" if self.shard else "")


@dataclass(frozen=True)
class Evaluation:
    candidate: Candidate
    iteration_s: float
    throughput: float  # sequences per second
    bubble_ratio: float  # 1 - busy / (D * iteration), compute only
    memory_bytes: float  # the fullest rank
    allreduce_share: float  # iteration time after the last compute and the optimizer step:
    # unhidden gradient sync (and a sharded optimizer's all-gather)
    compute_s: float  # the busiest rank's compute, its optimizer step included
    asynchronous: bool = False
    micro_scale: float = 1.0  # the schedule's micro-batch over B (0.5: backward halving)


@dataclass
class Stats:
    candidates: int = 0
    simulated: int = 0
    cut_by_bound: int = 0
    cut_by_memory_bound: int = 0
    out_of_memory: int = 0
    invalid: int = 0
    seconds: float = 0.0
    smallest_memory: tuple[float, Candidate | None] = (math.inf, None)


@dataclass
class PlanResult:
    workload: Workload
    top: list[Evaluation]
    best: dict[object, Evaluation]  # best per group (scheme by default)
    stats: Stats
    capacity: float
    schemes: list[str]  # the schemes searched


class _Search:
    """The running answer: the best ``top_k`` and the best per group, and what to beat.

    Only ``ranked`` schemes enter the top K (the runnable ones: an asynchronous scheme is
    another training algorithm, shown beside them, not offered as the answer)."""

    def __init__(self, top_k: int, group, ranked: set[str]):
        self.top_k, self.group, self.ranked = top_k, group, ranked
        self.top: list[Evaluation] = []
        self.best: dict[object, Evaluation] = {}

    def threshold(self, c: Candidate) -> float:
        """A candidate slower than this can neither enter the top K nor beat its group's best."""
        full = len(self.top) >= self.top_k or c.scheme not in self.ranked
        kth = self.top[-1].iteration_s if full and self.top else (0.0 if full else math.inf)
        mine = self.best[self.group(c)].iteration_s if self.group(c) in self.best else math.inf
        return max(kth, mine)

    def add(self, ev: Evaluation | None) -> None:
        if ev is None:
            return
        key = self.group(ev.candidate)
        if key not in self.best or ev.iteration_s < self.best[key].iteration_s:
            self.best[key] = ev
        if ev.candidate.scheme in self.ranked:
            self.top = sorted(self.top + [ev], key=lambda e: (e.iteration_s, e.candidate))[:self.top_k]


def variants(name: str, depth: int, layers: int) -> list[tuple[tuple[str, object], ...]]:
    """Every combination of the values the scheme's options search (``Option.search``);
    an option without them keeps the generator's default."""
    axes = []
    for option in () if is_reference(name) else get_scheme(name).declared:
        values = option.search(depth, layers) if option.search else []
        if values:
            axes.append([(option.name, v) for v in values])
    return [tuple(combo) for combo in itertools.product(*axes)]


def _runnable(name: str) -> bool:
    """A reference (torch's schedule) runs; a scheme of ours says."""
    return is_reference(name) or get_scheme(name).runnable


def _needs_even_depth(name: str) -> bool:
    """Schemes on the Chimera placement (two pipes in opposite directions) need D even."""
    for n in (2, 4, 8):
        try:
            return build(name, 2, n).placement.style == "chimera"
        except ScheduleError:
            continue
    return False


def check_request(work: Workload, names: list[str]) -> None:
    """Fail early, with one line, on requests no configuration can meet."""
    p, sizes = work.gpus, work.tensor_parallel
    of = "" if sizes == (1,) else f" / T (T in {', '.join(map(str, sizes))})"
    bidirectional = [n for n in names if not is_reference(n) and _needs_even_depth(n)]
    if bidirectional and all((p // t) % 2 for t in sizes):
        raise PlanError(f"--gpus {p}{of} has no even divisor D, which {', '.join(bidirectional)} "
                        f"need(s); choose an even P or leave them out with --schemes")
    layers = work.model.n_layers_total
    if not any(work.global_batch % (p // t // d) == 0 for t in sizes for d in divisors(p // t)
               if d <= layers):
        raise PlanError(f"global batch {work.global_batch} is not divisible by any data-parallel "
                        f"width W = P{of} / D of P = {p} with D <= {layers} (the model's layers)")


class Planner:
    def __init__(self, work: Workload, scheme_names: list[str] | None = None,
                 recompute: tuple[bool, ...] = (False, True), shapes: ShapeCache | None = None,
                 shard: tuple[bool, ...] = (False,), references: dict | None = None):
        """``references``: ``{"torch:NAME": factory(D, N) -> Schedule}``, schedules the user
        could run instead of ours (torch's, in their own order), ranked beside them."""
        names = list(scheme_names or [s.name for s in schemes()])
        for name in names:
            get_scheme(name)  # unknown names fail here, with the list of known ones
        check_request(work, names)
        names += list(references or {})
        self.work, self.names, self.recompute, self.shard = work, names, recompute, shard
        self.pricing = Pricing(work)
        self.capacity = work.capacity
        self.shapes = shapes or ShapeCache(references)
        self.stats = Stats()

    def candidates(self) -> list[Candidate]:
        out, g = [], self.work.global_batch
        layers = self.work.model.n_layers_total
        for t in self.work.tensor_parallel:
            p = self.work.gpus // t  # pipeline ranks: W * D
            for depth in divisors(p):
                width = p // depth
                if g % width or depth > layers:
                    continue
                for b in divisors(g // width):
                    n = g // (width * b)
                    for name in self.names:
                        for opts in variants(name, depth, layers):
                            shard = self.shard if _runnable(name) else (False,)
                            out += [Candidate(name, opts, depth, width, b, n, rc, sh, t)
                                    for rc in self.recompute for sh in shard]
        return out

    # -- pricing one candidate ------------------------------------------------------------
    def probe(self, c: Candidate) -> Shape | None:
        return self.shapes.probe(c.scheme, c.options, c.depth, c.micro_batches)

    def shape(self, c: Candidate) -> Shape | None:
        """Asynchronous schemes: a window of at least D micro-batches (their steady state)."""
        probe = self.probe(c)
        n = max(c.micro_batches, c.depth) if probe and probe.asynchronous else c.micro_batches
        return self.shapes.get(c.scheme, c.options, c.depth, n)

    def stage_costs(self, c: Candidate, shape: Shape) -> StageCosts | None:
        """None if the model cannot be cut that fine, or a schedule micro-batch would hold a
        fraction of a sequence (backward halving needs B even)."""
        s = shape.schedule
        sequences = c.micro_batch * s.micro_scale
        if s.stages > self.work.model.n_layers_total or sequences != int(sequences):
            return None
        return self.pricing.stage_costs(s.stages, sequences, c.recompute, c.tensor)

    def _times(self, c: Candidate, sc: StageCosts) -> OpTimes:
        """The stage costs' times with the hops of this candidate's depth."""
        link = self.work.hardware.p2p_link(c.depth * c.tensor)
        return replace(sc.times, hop=tuple(link.time(x) for x in sc.send_bytes))

    def _allreduce(self):
        return self.work.hardware.allreduce_link(self.work.gpus)

    def _async(self, c: Candidate, sc: StageCosts) -> tuple[float, float, list[float]]:
        syncs = c.micro_batches if c.scheme == "pipedream" else 1  # per micro-batch vs per batch
        optimizer = [self.work.hardware.optimizer_time(p) for p in sc.params]
        return bounds.async_parts(self._times(c, sc), sc.grad_bytes, c.micro_batches, syncs,
                                  self._allreduce(), c.width, optimizer)

    def lower_bounds(self, c: Candidate) -> tuple[float, float] | None:
        """(time, memory) no schedule of this candidate can beat; None if it is invalid."""
        probe = self.probe(c)
        sc = probe and self.stage_costs(c, probe)
        if sc is None:
            return None
        mem = memory_floor(probe.replicas, sc, self.work.precision, c.recompute,
                           self._shards(c, probe.schedule))
        if probe.asynchronous:
            return self._async(c, sc)[0], mem
        return bounds.time_floor(probe.schedule, self._times(c, sc), sc.grad_bytes, c.micro_batches,
                                 self._allreduce(), c.width), mem

    def memory(self, c: Candidate, shape: Shape, sc: StageCosts) -> float:
        """Bytes on the fullest rank: state of every replica held, peak activations."""
        s, worst = shape.schedule, 0.0
        for rank in range(s.ranks):
            params = sum(sc.params[stage] for _, stage in shape.replicas[rank])
            state = state_bytes(params, self.work.precision, weight_versions(s, rank),
                                self._shards(c, s))
            act = shape.held.peak(rank, sc.act_kept)
            if c.recompute:
                act += max(sc.act_full[st] for st in shape.held.stages[rank])
            worst = max(worst, state + act)
        return worst

    def evaluate(self, c: Candidate) -> Evaluation | None:
        """Simulate one candidate; None if its schedule cannot be built or it does not fit."""
        shape = self.shape(c)
        sc = shape and self.stage_costs(c, shape)
        if sc is None:
            self.stats.invalid += 1
            return None
        mem = self.memory(c, shape, sc)
        if mem < self.stats.smallest_memory[0]:
            self.stats.smallest_memory = (mem, c)
        if mem > self.capacity:
            self.stats.out_of_memory += 1
            return None
        if shape.asynchronous:
            self.stats.simulated += 1
            total, compute, busy = self._async(c, sc)
            return self._evaluation(c, shape, total, busy, compute, mem)
        compiled = shape.compiled()
        if compiled is None:
            self.stats.invalid += 1
            return None
        self.stats.simulated += 1
        cost = self.pricing.cost_model(sc, c.depth, c.width, shape.schedule.micro_scale, c.shard)
        t = compiled.times(cost, eager_sync=True)
        work_end = t.compute_end + max(t.optimizer)  # then come unhidden sync and all-gather
        return self._evaluation(c, shape, t.makespan, t.busy, work_end, mem)

    def tp_comm(self, e: Evaluation) -> float:
        """Seconds of TP collectives on the rank that spends most on them, in one iteration
        (0 at T = 1): each F waits its stage's forward collectives, each B or I the backward
        ones (and a recomputed forward's), W none."""
        c = e.candidate
        shape = self.shape(c)
        sc = shape and self.stage_costs(c, shape)
        if not sc or not sc.tp_f:
            return 0.0
        s = shape.schedule
        per = {Op.F: sc.tp_f, Op.B: sc.tp_b, Op.I: sc.tp_b}
        redo = sc.tp_f if c.recompute else (0.0,) * len(sc.tp_f)
        share = c.micro_batches / s.micro_batches if shape.asynchronous else 1.0  # its window
        return share * max(sum(per[a.op][a.stage] + (redo[a.stage] if a.op is not Op.F else 0.0)
                               for a in prog if a.op in per) for prog in s.programs)

    def _shards(self, c: Candidate, s) -> int:
        """Replicas the optimizer of a stage is split over (1: not sharded)."""
        return len(s.placement.replicas(0)) * c.width if c.shard else 1

    def _evaluation(self, c: Candidate, shape: Shape, total: float, busy: list[float],
                    work_end: float, mem: float) -> Evaluation:
        bubble = 1 - sum(busy) / (c.depth * total) if total > 0 else 0.0
        share = max(0.0, total - work_end) / total if total > 0 else 0.0
        return Evaluation(c, total, self.work.global_batch / total, bubble, mem, share,
                          max(busy), shape.asynchronous, shape.schedule.micro_scale)

    # -- the search -----------------------------------------------------------------------
    def quick_floor(self, c: Candidate) -> float:
        """(A smaller micro-batch, as backward halving runs, costs no less per sequence.)"""
        return bounds.quick_floor(c.micro_batches, c.depth,
                                  self.pricing.total_time(c.micro_batch, c.recompute, c.tensor))

    def run(self, top_k: int = 10, group=lambda c: c.scheme, only=None) -> PlanResult:
        """Best ``top_k`` overall and the best per ``group(candidate)``; ``only`` filters."""
        start = time.perf_counter()
        self.stats = Stats()
        search = self._search(top_k, group, only)
        self.stats.seconds = time.perf_counter() - start
        if not search.best:
            raise self._nothing_fits()
        if not search.top:  # only simulation-only schemes fit: rank them rather than nothing
            search.top = sorted(search.best.values(), key=lambda e: (e.iteration_s, e.candidate))[:top_k]
        return PlanResult(self.work, search.top, search.best, self.stats, self.capacity, self.names)

    def _search(self, top_k: int, group, only) -> _Search:
        """Best-first on :meth:`lower_bounds`, computed lazily: candidates wait in order of the
        cheap :meth:`quick_floor` and get their sharp bound (which needs a small probe
        schedule) once their quick floor is below every sharp bound known, so the candidate
        simulated next always has the least sharp bound of all that remain. A threshold
        only falls, so a candidate cut once is never needed later."""
        stats = self.stats
        queue = sorted((self.quick_floor(c), c) for c in self.candidates() if only is None or only(c))
        stats.candidates = len(queue)
        runnable = {n for n in self.names if _runnable(n)}
        search = _Search(top_k, group, runnable or set(self.names))
        ready: list[tuple[float, Candidate]] = []  # (sharp bound, candidate), a heap
        i = 0
        while i < len(queue) or ready:
            while i < len(queue) and (not ready or queue[i][0] < ready[0][0]):
                quick, c = queue[i]
                i += 1
                bound = self._sharp(c, quick, search.threshold(c))
                if bound is not None:
                    heapq.heappush(ready, (bound, c))
            if not ready:
                break
            bound, c = heapq.heappop(ready)
            if bound >= search.threshold(c):
                stats.cut_by_bound += 1
                continue
            search.add(self.evaluate(c))
        return search

    def _sharp(self, c: Candidate, quick: float, threshold: float) -> float | None:
        """The sharp time bound of ``c``, or None if it is cut (time, memory) or invalid."""
        if quick >= threshold:
            self.stats.cut_by_bound += 1
            return None
        found = self.lower_bounds(c)
        if found is None:
            self.stats.invalid += 1
            return None
        floor, mem = found
        if mem > self.capacity:
            self.stats.cut_by_memory_bound += 1
            if mem < self.stats.smallest_memory[0]:
                self.stats.smallest_memory = (mem, c)
            return None
        if floor >= threshold:
            self.stats.cut_by_bound += 1
            return None
        return floor

    def _nothing_fits(self) -> PlanError:
        need, c = self.stats.smallest_memory
        if c is None:
            return PlanError(f"no valid configuration for P={self.work.gpus}, "
                             f"G={self.work.global_batch} with schemes {', '.join(self.names)}")
        return PlanError(f"no configuration fits in {self.capacity / 2**30:.2f} GiB per rank; the "
                         f"smallest needs at least {need / 2**30:.2f} GiB ({c.variant} W={c.width} "
                         f"D={c.depth}{f' T={c.tensor}' if c.tensor > 1 else ''} B={c.micro_batch}"
                         f"{' recompute' if c.recompute else ''})")


@contextlib.contextmanager
def gc_paused():
    """Pause Python's cyclic garbage collector around a plan (reference counting still frees
    everything as usual; the collector's previous state is restored).

    A search allocates millions of small objects (tasks, actions, heap entries) and keeps the
    schedules it built until it ends; the collector walked them over and over to find next to
    no cycles: a quarter of the CPU time at P = 2,048. Let go of the :class:`Planner` inside
    the block, so that the collector has little to walk when it resumes.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def plan(work: Workload, scheme_names: list[str] | None = None, top_k: int = 10,
         recompute: tuple[bool, ...] = (False, True), shard: tuple[bool, ...] = (False,)) -> PlanResult:
    """The ``top_k`` fastest configurations of ``work`` that fit, and the best per scheme."""
    with gc_paused():
        return Planner(work, scheme_names, recompute, shard=shard).run(top_k)
