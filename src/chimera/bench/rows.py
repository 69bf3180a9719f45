"""What a benchmark runs: its configuration and its rows (no torch).

A row is one way of training the same model on the same mini-batch: ``single`` (one process,
the whole batch at once), ``chimera`` (our runtime with one of our schedules) or ``torch``
(``torch.distributed.pipelining`` with the same stage modules, cut and data).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chimera.bench.prices import PARTITIONS, priced
from chimera.errors import UserError
from chimera.ir import ScheduleError
from chimera.schedules import build, get_scheme, schemes
from chimera.sim.cost import parse_times

# Ours, in the order the table shows them; any other runnable scheme is appended unless it is
# in SKIPPED_SCHEMES (GEMS idles 75% of the time by design: it would only slow the run down).
OUR_ORDER = ("chimera", "1f1b", "gpipe", "interleaved", "zb-h1", "chimera-zb", "zb-v",
             "dualpipev", "dualpipe")
SKIPPED_SCHEMES = ("gems",)
# torch.distributed.pipelining: row name -> (schedule class, placement style, stages per rank)
TORCH_SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "linear", 1),
    "1f1b": ("Schedule1F1B", "linear", 1),
    "interleaved": ("ScheduleInterleaved1F1B", "loop", 2),
    "dualpipev": ("ScheduleDualPipeV", "v", 2),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", "loop", 2),
    "zbv": ("ScheduleZBVZeroBubble", "v", 2),
}
IMPLS = ("single", "chimera", "torch")


@dataclass(frozen=True)
class Row:
    impl: str  # single | chimera | torch | floor (our program on null-compute stages)
    schedule: str  # "none" for single
    options: tuple[tuple[str, object], ...] = ()  # e.g. (("chunks", 2),) or (("threads", 2),)

    @property
    def id(self) -> str:
        """``impl:schedule`` plus options, e.g. ``single:none:threads=2``, ``chimera:interleaved``."""
        ours = get_scheme(self.schedule) if self.impl in ("chimera", "floor") else None
        opts = "".join(f":{k}={v}" for k, v in self.options if not (ours and ours.is_default(k, v)))
        return f"{self.impl}:{self.schedule}{opts}"

    @property
    def opts(self) -> dict:
        return dict(self.options)

    @property
    def threads(self) -> int | None:
        return self.opts.get("threads")

    @property
    def scheme_options(self) -> dict:
        """The options our scheme takes (not the bench's own, such as ``shard``)."""
        return {k: v for k, v in self.opts.items() if k in get_scheme(self.schedule).options}


@dataclass(frozen=True)
class BenchConfig:
    """Every knob of a benchmark run; the defaults are the issue's configuration."""

    model: str = "gpt2-bench"
    stages: int = 2  # D ranks, one process each
    micro_batches: int = 8  # N
    micro_batch_size: int = 2  # B: the mini-batch is N*B sequences
    threads: int = 1  # torch threads per rank
    warmup: int = 2  # rounds not counted
    steps: int = 9  # measured rounds: the median of these is reported
    seed: int = 0
    rows: tuple[str, ...] | None = None  # row ids (or prefixes) to keep; None: all
    memory: bool = True  # measure peak RSS per row in fresh processes
    comm_timeout: float = 300.0
    quick: bool = False
    # accelerator-like stages (chimera.models.emulated): "F:I:W" or "F:B" in milliseconds per
    # micro-batch per D-th of the model; None: the real model on the CPU
    emulate: str | None = None
    activation_mb: float = 1.0  # emulated: activation kept per micro-batch per D-th (MiB)
    spin: bool = False  # emulated: busy-wait instead of sleeping (a core per rank)
    # emulated: what the placement costs and saves, priced alike on every row (bench.prices)
    head: float = 1.0  # the last D-th of the model costs this many D-ths (the LM head)
    embed: float = 1.0  # the first D-th likewise (the embedding)
    head_params: float = 1.0  # the last D-th's gradients are this many D-ths (the LM head's)
    embed_params: float = 1.0  # the first D-th's likewise (the embedding's)
    layers_per_stage: int = 2  # layers per D-th of the model
    partition: str = "layers"  # same layer count per stage, or "cost": cut for each placement's ranks
    link_ms: float = 0.0  # each p2p hop delivered this much later
    allreduce_ms: float = 0.0  # a D-th of the model's gradients takes this long to allreduce
    data_parallel: int = 1  # W pipeline copies on W*D ranks (W >= 2: every schedule reduces)
    # emulated: also our rows with ZeRO-1 over each stage's group (reduce-scatter, all-gather)
    shard_optimizer: bool = False
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("stages", "micro_batches", "micro_batch_size", "threads", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"bench {name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise UserError(f"bench warmup must be a non-negative integer, got {self.warmup!r}")
        if self.emulate is not None:
            parse_times(self.emulate, "--emulate (milliseconds)")  # one line for a bad F:I:W
        if self.spin and self.emulate is None:
            raise UserError("bench spin applies to emulated stages only (--emulate F:I:W)")
        if not (isinstance(self.activation_mb, (int, float)) and 0 <= self.activation_mb < 2**20):
            raise UserError(f"bench activation-mb must be a number in [0, 2^20), got {self.activation_mb!r}")
        self._check_prices()

    def _check_prices(self) -> None:
        for name in ("head", "embed", "head_params", "embed_params"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 1 <= value < 1e6):
                raise UserError(f"bench {name.replace('_', '-')} must be a number >= 1 (D-ths of "
                                f"the model), got {value!r}")
        for name in ("link_ms", "allreduce_ms"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < 1e6):
                raise UserError(f"bench {name.replace('_', '-')} must be a number >= 0, got {value!r}")
        for name in ("layers_per_stage", "data_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"bench {name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.partition not in PARTITIONS:
            raise UserError(f"bench partition must be one of {', '.join(PARTITIONS)}, "
                            f"got {self.partition!r}")
        if not isinstance(self.shard_optimizer, bool):
            raise UserError(f"bench shard-optimizer must be True or False, got {self.shard_optimizer!r}")
        if self.emulate is None and (priced(self) or self.shard_optimizer):
            raise UserError("bench head, embed, their params, partition, link, allreduce, "
                            "data-parallel and layers price emulated stages only (--emulate F:I:W)")

    @classmethod
    def quick_config(cls, **kw) -> "BenchConfig":
        """About 10 minutes on a 2-core machine: one warm-up round, median of 5."""
        return cls(**{"warmup": 1, "steps": 5, "quick": True, **kw})

    @property
    def global_batch(self) -> int:
        """Sequences per step: N micro-batches of B on each of W pipeline copies."""
        return self.micro_batches * self.micro_batch_size * self.data_parallel

    @property
    def world(self) -> int:
        """Ranks of a pipelined row: W copies of D."""
        return self.stages * self.data_parallel

    @property
    def rounds(self) -> int:
        return self.warmup + self.steps

    def to_dict(self) -> dict:
        return {"model": self.model, "stages": self.stages, "micro_batches": self.micro_batches,
                "micro_batch_size": self.micro_batch_size, "global_batch": self.global_batch,
                "threads_per_rank": self.threads, "warmup": self.warmup, "steps": self.steps,
                "seed": self.seed, "backend": "gloo", "quick": self.quick,
                **({"emulate_ms": self.emulate, "activation_mb": self.activation_mb,
                    "waits": "spin" if self.spin else "sleep", "head": self.head,
                    "embed": self.embed, "head_params": self.head_params,
                    "embed_params": self.embed_params, "layers_per_stage": self.layers_per_stage,
                    "partition": self.partition, "link_ms": self.link_ms,
                    "allreduce_ms": self.allreduce_ms, "data_parallel": self.data_parallel,
                    "shard_optimizer": self.shard_optimizer}
                   if self.emulate else {}), **self.extra}


def our_schemes() -> list[str]:
    """Runnable schemes of ours in table order (whatever the registry holds right now)."""
    names = [s.name for s in schemes() if getattr(s, "runnable", True)]
    ordered = [n for n in OUR_ORDER if n in names]
    return ordered + [n for n in names if n not in ordered and n not in SKIPPED_SCHEMES]


def all_rows(cfg: BenchConfig) -> list[Row]:
    """Every row the benchmark knows, before filtering."""
    if cfg.emulate:  # no host compute to compare with
        ours = [r for name in our_schemes() for r in scheme_rows(name)]
        theirs = [Row("torch", name) for name in TORCH_SCHEDULES]
        if cfg.shard_optimizer:  # ZeRO-1 where a stage's gradients are summed over a group
            ours += [sharded(r) for r in ours if cfg.data_parallel > 1 or _replicated(cfg, r)]
            theirs += [sharded(r) for r in theirs] if cfg.data_parallel > 1 else []
        # each scheme's program again on null-compute stages (bench.emulated.EmulatedFloor)
        floors = [Row("floor", name, scheme_rows(name)[0].options) for name in our_schemes()]
        return ours + theirs + floors
    rows = [Row("single", "none", (("threads", 1),)), Row("single", "none", (("threads", 2),)),
            # the same micro-batches as the pipelines, accumulated: the linear limit without
            # the (cache) cost or benefit of computing the whole mini-batch at once
            Row("single", "none", (("threads", 1), ("micro_batches", cfg.micro_batches)))]
    for name in our_schemes():
        ours = scheme_rows(name)
        rows += ours
        if name == "chimera":  # ZeRO-1 over the two replicas: half the AdamW state and work per rank
            rows += [sharded(r) for r in ours]
    rows += [Row("torch", name) for name in TORCH_SCHEDULES]
    return rows


def sharded(row: Row) -> Row:
    """``row`` with the optimizer sharded over each stage's group (ZeRO-1; torch's: its
    FSDP-like counterpart, :mod:`chimera.bench.torch_dp`)."""
    return Row(row.impl, row.schedule, row.options + (("shard", 1),))


def _replicated(cfg: BenchConfig, row: Row) -> bool:
    """Whether ``row``'s placement holds a stage on several ranks (Chimera's), so that at W=1
    its stages have a group to shard over."""
    try:
        plan = build(row.schedule, cfg.stages, cfg.micro_batches, **row.scheme_options)
    except UserError:  # a scheme that does not run at this (D, N): its row fails as it is
        return False
    return len(plan.placement.replicas(0)) > 1


def scheme_rows(name: str) -> list[Row]:
    """The scheme at its defaults, then one row per value its options ask the benchmark to
    run (``Option.bench``; a default among them is written out in the first row)."""
    declared = get_scheme(name).declared
    rows = [Row("chimera", name, tuple((o.name, o.default) for o in declared if o.default in o.bench))]
    for o in declared:
        rows += [Row("chimera", name, ((o.name, v),)) for v in o.bench if v != o.default]
    return rows


def _matches(row: Row, want: str) -> bool:
    return row.id == want or row.id.startswith(want + ":")


def select_rows(cfg: BenchConfig) -> list[Row]:
    """The rows ``cfg.rows`` asks for: exact ids, or prefixes such as ``torch`` or ``single``."""
    rows = all_rows(cfg)
    if cfg.rows is None:
        return rows
    unknown = [w for w in cfg.rows if not any(_matches(r, w) for r in rows)]
    if unknown:
        raise ScheduleError(f"unknown bench row(s) {', '.join(unknown)}; known: "
                            f"{', '.join(r.id for r in rows)}")
    return [r for r in rows if any(_matches(r, w) for w in cfg.rows)]
