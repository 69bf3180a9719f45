"""TrainConfig: every knob of a training run, validated before any process starts."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields
from functools import cached_property

from chimera.ir import Schedule, ScheduleError

WIRE_DTYPES = {None: None, "bf16": "bfloat16", "float16": "float16"}  # name -> torch attribute
DTYPES = ("float32", "float64", "bf16")


class ConfigError(ValueError):
    """A training configuration that cannot run; the message says what to change."""


@dataclass(frozen=True)
class TrainConfig:
    model: str = "gpt2-tiny"
    schedule: str = "chimera"  # or "none" for plain single-process training (the reference)
    stages: int = 2
    micro_batches: int | None = None  # default: 2D (two of chimera's basic units)
    micro_batch_size: int = 4
    data_parallel: int = 1
    steps: int = 40
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int | None = None  # default: 10% of the steps
    weight_decay: float = 0.1
    clip: float = 1.0  # global gradient norm; 0 disables clipping
    seed: int = 0
    recompute: bool = False
    strategy: str | None = None
    pipes: int | None = None
    chunks: int | None = None
    sync: str = "eager"
    partition: str | None = None  # e.g. "0-2,3-5": layer ranges per stage
    data: str | None = None
    dtype: str = "float32"
    wire_dtype: str | None = None  # bf16 | float16: boundary tensors on the wire (None: as computed)
    threads: int = 1
    comm_timeout: float = 300.0
    backend: str = "auto"  # gloo on CPU, nccl on CUDA
    device: str = "auto"  # cpu | cuda | auto
    log_json: str | None = None
    trace: str | None = None  # Perfetto trace of one measured step
    png: str | None = None  # Gantt chart of the same step
    trace_step: int | None = None  # which step to record (default: the last)
    progress: bool = True
    checkpoint_dir: str | None = None  # DCP checkpoints step-<n>/ here (and one at the end)
    checkpoint_every: int = 0  # steps between checkpoints; 0: only the final one
    keep_checkpoints: int = 3
    resume: bool = False  # continue from the newest checkpoint in checkpoint_dir, if any
    skip_nonfinite: bool = False  # skip a step with a NaN/inf loss or grad norm instead of stopping

    def __post_init__(self) -> None:
        self._check_numbers()
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ConfigError(f"--wire-dtype must be one of {', '.join(k for k in WIRE_DTYPES if k)}, "
                              f"got {self.wire_dtype!r}")
        if self.reference and (self.stages != 1 or self.data_parallel != 1):
            raise ConfigError("--schedule none is single-process training: use --stages 1 "
                              "--data-parallel 1")
        if not self.reference and self.stages < 2 and self.schedule != "1f1b":
            raise ConfigError(f"--schedule {self.schedule} needs --stages >= 2 "
                              f"(use --schedule none --stages 1 for single-process training)")
        if not self.reference:
            _check_runnable(self.schedule)
        if self.data is not None and not os.path.exists(self.data):
            raise ConfigError(f"--data {self.data}: no such file or directory")
        self._check_model()
        if not self.reference:
            self.build_schedule()  # raises ScheduleError on impossible layouts
        self._check_checkpoint()

    def _check_numbers(self) -> None:
        for name in ("stages", "micro_batch_size", "data_parallel", "steps", "threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.micro_batches is not None and (not isinstance(self.micro_batches, int) or self.micro_batches < 1):
            raise ConfigError(f"--micro-batches must be a positive integer, got {self.micro_batches!r}")
        for name, low in (("lr", 0.0), ("weight_decay", 0.0), ("clip", 0.0), ("comm_timeout", 0.0),
                          ("min_lr_ratio", 0.0)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value) or value < low:
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number >= {low:g}, got {value!r}")
        if self.lr <= 0:
            raise ConfigError(f"--lr must be positive, got {self.lr!r}")
        if self.comm_timeout <= 0:
            raise ConfigError(f"--comm-timeout must be positive, got {self.comm_timeout!r}")

    def _check_model(self) -> None:
        from chimera.models import get_config

        try:
            cfg = get_config(self.model)
        except ValueError as exc:  # lists the presets
            raise ConfigError(f"--model: {exc}") from None
        if self.stages_total > cfg.n_layers_total:
            raise ConfigError(f"cannot cut {self.model} ({cfg.n_layers_total} layers: embedding, "
                              f"{cfg.n_layer} blocks, head) into {self.stages_total} stages")
        if self.strategy == "halving" and self.micro_batch_size % 2:
            raise ConfigError("backward halving splits each micro-batch in two: "
                              "--micro-batch-size must be even")

    def _check_checkpoint(self) -> None:
        for name, low in (("checkpoint_every", 0), ("keep_checkpoints", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value!r}")
        if self.checkpoint_dir is None:
            if self.resume or self.checkpoint_every:
                raise ConfigError("--resume and --checkpoint-every need --checkpoint-dir")
            return
        where = os.path.abspath(self.checkpoint_dir)
        if os.path.exists(where) and not os.path.isdir(where):
            raise ConfigError(f"--checkpoint-dir {self.checkpoint_dir}: exists and is not a directory")
        parent = where
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(f"--checkpoint-dir {self.checkpoint_dir}: {parent} is not writable")
        if self.resume:
            self._check_resumable()
        else:
            self._check_unowned()

    def _check_unowned(self) -> None:
        """A directory holding checkpoints belongs to their run: only --resume continues it."""
        from chimera.train import checkpoint

        newest = checkpoint.latest(self.checkpoint_dir)
        if newest is not None:
            raise ConfigError(checkpoint.foreign_message(self.checkpoint_dir, newest))

    def _check_resumable(self) -> None:
        from chimera.train import checkpoint

        path = checkpoint.latest(self.checkpoint_dir)
        if path is None:
            return  # nothing yet: --resume starts from scratch (the same command restarts)
        try:
            checkpoint.verify(path, self.model, checkpoint.model_fingerprint(self.model))
        except checkpoint.CheckpointError as exc:
            raise ConfigError(f"--resume: {exc}") from None

    # -- derived ------------------------------------------------------------------
    @property
    def reference(self) -> bool:
        return self.schedule == "none"

    @property
    def n_micro(self) -> int:
        return self.micro_batches or (1 if self.reference else 2 * self.stages)

    @property
    def global_batch(self) -> int:
        return self.data_parallel * self.n_micro * self.micro_batch_size

    @property
    def world(self) -> int:
        return self.data_parallel * self.stages

    @property
    def stages_total(self) -> int:
        """Model pieces: D, or v·D (interleaved), 2D (V placements)."""
        if self.reference:
            return 1
        return self.build_schedule().stages

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else max(1, self.steps // 10)

    def build_schedule(self) -> Schedule:
        """The lowered, validated schedule (built once per config)."""
        return self._schedule

    @cached_property
    def _schedule(self) -> Schedule:
        from chimera.passes import lower
        from chimera.schedules import build
        from chimera.validate import validate

        try:
            s = build(self.schedule, self.stages, self.n_micro, pipes=self.pipes,
                      chunks=self.chunks, strategy=self.strategy)
        except ScheduleError as exc:
            raise ConfigError(str(exc).splitlines()[0]) from None
        return validate(lower(s, self.sync))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]



def _check_runnable(name: str) -> None:
    from chimera.schedules import require_runnable

    try:
        require_runnable(name)
    except ScheduleError as exc:  # an unknown or a simulation-only scheme
        raise ConfigError(str(exc)) from None
