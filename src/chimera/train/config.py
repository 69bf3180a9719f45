"""TrainConfig: every knob of a training run. Its values are checked when it is made; what
needs files or building (data, model, schedule, checkpoints) by ``preflight()``, which
``chimera train`` and ``launch`` call before any process starts.

The module imports without torch (the CLI parses and checks flags before torch loads), so
what needs torch is imported inside the function that uses it."""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from pathlib import Path

from chimera.errors import UserError
from chimera.ir import Schedule, ScheduleError
from chimera.passes import lower
from chimera.schedules import build, require_runnable
from chimera.schedules.registry import option_declarations
from chimera.train import resume
from chimera.check.validate import validate

WIRE_DTYPES = {None: None, "bf16": "bfloat16", "float16": "float16"}  # name -> torch attribute
# bf16: float32 weights under bf16 autocast; bf16-master: bf16 weights, float32 master copies
# and optimizer state; fp16: float32 weights under float16 autocast with a loss scaler
DTYPES = ("float32", "float64", "bf16", "bf16-master", "fp16")
LR_SCHEDULES = ("cosine", "linear", "wsd", "constant")  # the shape after warm-up (train/optim.lr_at)
# sizes refused before anything is allocated (the schedule's own limits are in
# chimera.schedules.registry): a micro-batch is (B, seq_len) tokens on every first stage
# below a second the ranks cannot even rendezvous; above a week is no timeout (and overflows C)
MIN_COMM_TIMEOUT_S, MAX_COMM_TIMEOUT_S = 1.0, 7 * 24 * 3600.0
LIMITS = {"micro_batch_size": 65536, "data_parallel": 1024, "threads": 1024, "eval_batches": 10000,
          "grad_accum": 65536}
RESUME_ALLOWABLE = ("data",)  # refused on --resume unless named in --resume-allow


class ConfigError(UserError):
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
    shard_optimizer: bool = False  # ZeRO-1 over each stage's replica group (runtime/shard.py)
    strategy: str | None = None
    pipes: int | None = None
    chunks: int | None = None
    options: dict | None = None  # any other option the scheme declares, e.g. {"cap": 3} (chimera-zb)
    sync: str = "eager"
    partition: str | None = None  # e.g. "0-2,3-5": layer ranges per stage
    seq_len: int | None = None  # tokens per sequence (default: the model's: its preset or config)
    data: str | None = None  # text, token files, .jsonl, a datasets folder (chimera.data.formats)
    token_dtype: str | None = None  # uint16 | uint32: the ids of a .bin token file
    vocab_size: int | None = None  # ids are below it; the model's vocabulary (default: the data's)
    text_field: str | None = None  # the text of a .jsonl object or a datasets row (default: text)
    tokenizer: str | None = None  # tokenizer.json (HF tokenizers) text goes through (default: bytes)
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
    skip_limit: int = 10  # ... but stop after this many skipped in a row (train/keeper.py)
    spike_factor: float = 2.0  # a loss above this times its recent median is in doubt; 0: off
    eval_every: int = 0  # held-out loss every K steps and at the end; 0: never
    eval_batches: int = 8  # mini-batches of the held-out split per evaluation (the same ones each time)
    # -- issue 25: the knobs people expect, and watching a run ---------------------------
    lr_schedule: str = "cosine"  # after warm-up: cosine | linear | wsd | constant, down to min_lr_ratio
    wsd_decay: float = 0.2  # wsd: the last fraction of the steps decays (the rest holds the peak)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_accum: int = 1  # mini-batches summed per optimizer step (the step's batch is K times larger)
    compile: bool = False  # torch.compile every stage module (nn.Module.compile: names unchanged)
    tensorboard: str | None = None  # a folder for TensorBoard event files (rank 0 writes them)
    peak_flops: float | None = None  # per rank, for model FLOPs utilization (default: see peak_flops_per_rank)
    resume_allow: tuple[str, ...] = ()  # fields a --resume may change that it refuses otherwise (data)

    def __post_init__(self) -> None:
        """Values only: no file is read and nothing is built (that is :meth:`preflight`)."""
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
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.schedule_options.get("strategy") == "halving" and self.micro_batch_size % 2:
            raise ConfigError("backward halving splits each micro-batch in two: "
                              "--micro-batch-size must be even")
        self.data_spec  # the data flags' values (--token-dtype, --vocab-size, --text-field)
        self._check_checkpoint_values()
        self._check_eval()
        self._check_knobs()

    def preflight(self) -> "TrainConfig":
        """Every check that reads files or builds something, so that a run that cannot start
        fails here, before any process starts: --data exists and its format and vocabulary
        (from layout and metadata), the model and its cut into stages, the GPUs, the schedule
        (built, lowered and validated), and --checkpoint-dir (writable; its newest checkpoint
        verified for --resume, refused without it). Returns ``self``; a second call does
        nothing. ``chimera train`` and :func:`chimera.train.launch` call it."""
        if self.__dict__.get("_preflight_done"):
            return self
        if self.data is not None:
            self._check_data_path()
        self.data_info  # the format and vocabulary of --data, from its layout and metadata
        self._check_model()
        self._check_gpus()
        if not self.reference:
            self.build_schedule()  # raises ConfigError on impossible layouts
        self._check_checkpoint_dir()
        self._check_tensorboard()
        object.__setattr__(self, "_preflight_done", True)  # frozen: not a field, not compared
        return self

    def _check_numbers(self) -> None:
        for name in ("stages", "micro_batch_size", "data_parallel", "steps", "threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
            if value > LIMITS.get(name, value):
                raise ConfigError(f"--{name.replace('_', '-')} {value} exceeds the limit of {LIMITS[name]}")
        for name in ("micro_batches", "seq_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        for name, low in (("lr", 0.0), ("weight_decay", 0.0), ("clip", 0.0), ("comm_timeout", 0.0),
                          ("min_lr_ratio", 0.0)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value) or value < low:
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number >= {low:g}, got {value!r}")
        if self.lr <= 0:
            raise ConfigError(f"--lr must be positive, got {self.lr!r}")
        self._check_health_values()
        if not MIN_COMM_TIMEOUT_S <= self.comm_timeout <= MAX_COMM_TIMEOUT_S:
            raise ConfigError(f"--comm-timeout must be between {MIN_COMM_TIMEOUT_S:g} and "
                              f"{MAX_COMM_TIMEOUT_S:g} seconds, got {self.comm_timeout!r}")

    def _check_health_values(self) -> None:
        """--warmup, --skip-limit and --spike-factor (``chimera.train.health``)."""
        w = self.warmup
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 0):
            raise ConfigError(f"--warmup must be an integer >= 0, got {w!r}")
        k = self.skip_limit
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 10**6:
            raise ConfigError(f"--skip-limit must be an integer between 1 and 1000000, got {k!r}")
        f = self.spike_factor
        if not isinstance(f, (int, float)) or not math.isfinite(f) or (f != 0 and f <= 1):
            raise ConfigError(f"--spike-factor must be a finite number > 1, or 0 for no spike "
                              f"rule, got {f!r}")

    def _check_data_path(self) -> None:
        from chimera.data import special_kind  # lazy: it imports torch

        if not os.path.exists(self.data):
            raise ConfigError(f"--data {self.data}: no such file or directory")
        kind = special_kind(Path(self.data))
        if kind:
            raise ConfigError(f"--data {self.data} is {kind}: give a regular text file or a "
                              "directory of them")

    def _check_model(self) -> None:
        source = self.model_source
        if self.stages_total > source.num_layers:
            raise ConfigError(f"cannot cut {self.model} ({source.num_layers} layers: embedding, "
                              f"{source.num_layers - 2} blocks, head) into {self.stages_total} stages")
        if self.partition is not None and not self.reference:
            self._check_partition(source.num_layers)
        if self.shard_optimizer and self.stages_total > 1:
            from chimera.byo import refuse_sharded_ties  # lazy: the module imports without torch

            refuse_sharded_ties([source.key(t[0]) for t in source.ties], "--shard-optimizer")

    def _check_partition(self, n_layers: int) -> None:
        from chimera.models.partition import parse_partition  # lazy: it imports torch

        try:
            ranges = parse_partition(self.partition, n_layers)
        except UserError as exc:
            raise ConfigError(f"--partition {self.partition}: {str(exc).splitlines()[0]}") from None
        if len(ranges) != self.stages_total:
            raise ConfigError(f"--partition {self.partition} gives {len(ranges)} stages, the "
                              f"schedule needs {self.stages_total}")

    def _check_gpus(self) -> None:
        if self.device == "cuda":
            import torch  # lazy: the module imports without torch

            if not torch.cuda.is_available():
                raise ConfigError("--device cuda: this torch build has no CUDA or no GPU is "
                                  "visible; use --device cpu")
            if self.world > torch.cuda.device_count() and "WORLD_SIZE" not in os.environ:
                raise ConfigError(f"--device cuda: the layout needs {self.world} GPUs (one per "
                                  f"rank), {torch.cuda.device_count()} are visible")

    def _check_checkpoint_values(self) -> None:
        for name, low in (("checkpoint_every", 0), ("keep_checkpoints", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value!r}")
        if self.checkpoint_dir is None and (self.resume or self.checkpoint_every):
            raise ConfigError("--resume and --checkpoint-every need --checkpoint-dir")

    def _check_checkpoint_dir(self) -> None:
        if self.checkpoint_dir is None:
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

    def _check_eval(self) -> None:
        for name, low in (("eval_every", 0), ("eval_batches", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value!r}")
        if self.eval_batches > LIMITS["eval_batches"]:
            raise ConfigError(f"--eval-batches {self.eval_batches} exceeds the limit of "
                              f"{LIMITS['eval_batches']}")

    def _check_knobs(self) -> None:
        """The optimizer, schedule-shape, precision and monitoring flags (issue 25)."""
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, "
                              f"got {self.lr_schedule!r}")
        for name, lo, hi in (("min_lr_ratio", 0.0, 1.0), ("wsd_decay", 0.0, 1.0),
                             ("adam_beta1", 0.0, 1.0), ("adam_beta2", 0.0, 1.0)):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and lo <= value <= hi) or \
                    (name.startswith("adam") and value == 1.0):
                top = "< 1" if name.startswith("adam") else "<= 1"
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0 and {top}, got {value!r}")
        if not (isinstance(self.adam_eps, (int, float)) and 0 < self.adam_eps < math.inf):
            raise ConfigError(f"--adam-eps must be a finite number > 0, got {self.adam_eps!r}")
        if self.warmup is not None and (not isinstance(self.warmup, int) or self.warmup < 0):
            raise ConfigError(f"--warmup must be an integer >= 0, got {self.warmup!r}")
        if not isinstance(self.grad_accum, int) or isinstance(self.grad_accum, bool) \
                or not 1 <= self.grad_accum <= LIMITS["grad_accum"]:
            raise ConfigError(f"--grad-accum must be an integer from 1 to {LIMITS['grad_accum']}, "
                              f"got {self.grad_accum!r}")
        if self.peak_flops is not None and not (isinstance(self.peak_flops, (int, float))
                                                and 0 < self.peak_flops < math.inf):
            raise ConfigError(f"--peak-flops must be a finite number > 0, got {self.peak_flops!r}")
        if isinstance(self.resume_allow, str):  # "data" or "data,seed", as the flag takes it
            object.__setattr__(self, "resume_allow",
                               tuple(n.strip() for n in self.resume_allow.split(",") if n.strip()))
        unknown = set(self.resume_allow) - set(RESUME_ALLOWABLE)
        if unknown:
            raise ConfigError(f"--resume-allow takes {', '.join(RESUME_ALLOWABLE)}, got "
                              f"{', '.join(sorted(unknown))}")
        if self.dtype == "bf16-master" and self.shard_optimizer:
            raise ConfigError("--dtype bf16-master with --shard-optimizer is not supported yet: "
                              "the sharded optimizer updates slices of the parameters themselves")

    def _check_tensorboard(self) -> None:
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("--tensorboard needs the tensorboard package: pip install "
                              "'chimera-pipeline[torch]' (or tensorboard)")

    def _check_unowned(self) -> None:
        """A directory holding checkpoints belongs to their run: only --resume continues it."""
        from chimera.train import checkpoint  # lazy: it imports torch
        from chimera.train.checkpoint import lease

        newest = checkpoint.latest(self.checkpoint_dir)
        if newest is not None:
            raise ConfigError(lease.foreign_message(self.checkpoint_dir, newest))

    def _check_resumable(self) -> None:
        from chimera.train import checkpoint  # lazy: it imports torch

        path, skipped = checkpoint.resumable(self.checkpoint_dir)
        if path is None and skipped:
            raise ConfigError(f"--resume: every checkpoint in {self.checkpoint_dir} is in doubt "
                              f"(newest {skipped[0][0].name}: {skipped[0][1]}); move them away "
                              "to start afresh, or resume one by moving the newer ones away")
        if path is None:
            return  # nothing yet: --resume starts from scratch (the same command restarts)
        try:
            meta = checkpoint.verify(path)  # intact; the model is compared field by field below
        except checkpoint.CheckpointError as exc:
            raise ConfigError(f"--resume: {exc}") from None
        self._check_changes(path, meta)
        data = meta.get("data") or {}
        if "mask_id" in data and data["mask_id"] != self.mask_id:  # older checkpoints: no record
            raise ConfigError(f"--resume: checkpoint {path} was trained with mask id "
                              f"{data['mask_id']}, this run's data masks with {self.mask_id}: "
                              "resume on the run's data and tokenizer")

    def _check_changes(self, path, meta: dict) -> None:
        """Refuse what a resume must not change, one line per field; keep what it accepts
        (``resume_changes``) for the launcher to announce."""
        refused, accepted = resume.compare(meta, self, self.model_source.fingerprint())
        if len(refused) == 1:  # one line, as every refusal of bad input
            raise ConfigError(f"--resume: {path} was written by another run: {refused[0].strip()}; "
                              f"{resume.REFUSES}")
        if refused:
            raise ConfigError("\n".join([f"--resume: {path} was written by a run this one may not "
                                          f"continue; what differs:", *refused, resume.SUMMARY]))
        object.__setattr__(self, "_resume_changes", (path, accepted))  # frozen: not a field

    @property
    def resume_changes(self) -> list[str]:
        """What ``--resume`` found changed and accepts, one line each (after ``preflight``)."""
        return self.__dict__.get("_resume_changes", (None, []))[1]

    @property
    def resume_from(self):
        """The checkpoint ``resume_changes`` were found against (after ``preflight``)."""
        return self.__dict__.get("_resume_changes", (None, []))[0]

    # -- derived ------------------------------------------------------------------
    @property
    def reference(self) -> bool:
        return self.schedule == "none"

    @property
    def n_micro(self) -> int:
        return self.micro_batches or (1 if self.reference else 2 * self.stages)

    @property
    def global_batch(self) -> int:
        """Sequences per pass of the schedule (an optimizer step sums ``grad_accum`` of them)."""
        return self.data_parallel * self.n_micro * self.micro_batch_size

    @property
    def step_batch(self) -> int:
        """Sequences per optimizer step: ``grad_accum`` mini-batches of ``global_batch``."""
        return self.global_batch * self.grad_accum

    @cached_property
    def data_spec(self):
        """--data and the flags that say how to read it (``chimera.data.formats.DataSpec``)."""
        from chimera.data.formats import DataSpec  # lazy: it imports torch

        try:
            return DataSpec(self.data, self.token_dtype, self.vocab_size, self.text_field,
                            self.tokenizer)
        except UserError as exc:
            raise ConfigError(str(exc)) from None

    @cached_property
    def data_info(self):
        """The format of --data and its vocabulary, found without reading the ids (those are
        read and checked by ``open_data``: in ``chimera train`` before any process starts)."""
        from chimera.data.formats import describe  # lazy: it imports torch

        try:
            return describe(self.data_spec)
        except ValueError as exc:
            raise ConfigError(str(exc).splitlines()[0]) from None

    @cached_property
    def model_source(self):
        """What ``--model`` builds (``chimera.train.sources``), its vocabulary the data's: a
        chimera preset (plus BERT's mask id on ids) or a Hugging Face model."""
        import torch  # lazy: the module imports without torch

        from chimera.train.sources import is_hf, open_source  # lazy: it imports torch

        dtype = torch.float64 if self.dtype == "float64" else torch.float32  # bf16: autocast
        try:
            return open_source(self.model, self.data_info, self.seq_len, dtype)
        except ImportError as exc:  # the hf extra is missing
            raise ConfigError(f"--model {self.model}: {exc}") from None
        except ValueError as exc:
            line = str(exc).splitlines()[0]
            if not line.startswith("--"):
                line = f"--model {self.model}: {line}" if is_hf(self.model) else f"--model: {line}"
            raise ConfigError(line) from None

    @property
    def mask_id(self) -> int | None:
        """The id BERT masks with (``chimera.data.bert_mask_id``: the tokenizer's mask token,
        else the model vocabulary's last id); None for a causal model."""
        from chimera.data import bert_mask_id  # lazy: it imports torch

        source = self.model_source
        return bert_mask_id(self.data_info, source.vocab_size) if source.kind == "bert" else None

    @property
    def model_config(self):
        """A chimera preset's ``ModelConfig`` with the data's vocabulary (``chimera bench``
        reads it; the trainer reads ``model_source``, which any model has)."""
        from chimera.train.sources import PresetSource  # lazy: it imports torch

        if not isinstance(self.model_source, PresetSource):
            raise ConfigError(f"{self.model} is not a chimera preset: it has no ModelConfig")
        return self.model_source.config

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

        try:
            s = build(self.schedule, self.stages, self.n_micro, **self.schedule_options)
        except ScheduleError as exc:
            raise ConfigError(str(exc).splitlines()[0]) from None
        return validate(lower(s, self.sync))

    @property
    def schedule_options(self) -> dict:
        """The scheme's options: the named fields and ``options`` (``build`` checks them against
        the registry's declarations)."""
        if self.options is not None and not isinstance(self.options, dict):
            raise ConfigError(f"options must be a dict of scheme options, got {self.options!r}")
        extra = dict(self.options or {})
        named = {k: getattr(self, k) for k in self.option_fields()}
        twice = [k for k in extra if named.get(k) is not None]
        if twice:
            raise ConfigError(f"scheme option(s) {', '.join(twice)} given twice: as a field and in options")
        return {**named, **{k: v for k, v in extra.items() if v is not None}}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def option_fields(cls) -> list[str]:
        """The scheme options that are fields of their own (any other goes in ``options``)."""
        return [k for k in option_declarations() if k in cls.field_names()]



def _check_runnable(name: str) -> None:

    try:
        require_runnable(name)
    except ScheduleError as exc:  # an unknown or a simulation-only scheme
        raise ConfigError(str(exc)) from None
