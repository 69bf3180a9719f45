"""The sections of a training run's configuration: frozen dataclasses, one per concern.

Each field is written once, here: its type (a ``Literal`` lists the choices), its default and
its help (``metadata["help"]``, which the command line shows). A field's name is its flag
(``micro_batch_size`` is ``--micro-batch-size``) and is unique across the sections, so a run
can be written flat (``TrainConfig(stages=4, lr=1e-3)``), as flags or as a TOML file with one
table per section. Each section checks its own values when it is made (``ConfigError`` naming
the flag); what needs files or building is ``chimera.train.build``.

Imports no torch (the command line checks flags before torch loads).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Literal

from chimera.errors import UserError
from chimera.ir import ScheduleError
from chimera.schedules import default_micro_batches, require_runnable
from chimera.schedules.registry import option_declarations

WIRE_DTYPES = {None: None, "bf16": "bfloat16", "float16": "float16"}  # name -> torch attribute
# bf16: float32 weights under bf16 autocast; bf16-master: bf16 weights, float32 master copies
# and optimizer state; fp16: float32 weights under float16 autocast with a loss scaler
DTYPES = ("float32", "float64", "bf16", "bf16-master", "fp16")
LR_SCHEDULES = ("cosine", "linear", "wsd", "constant")  # the shape after warm-up (train/optim.lr_at)
DEVICES = ("auto", "cpu", "cuda")
# below a second the ranks cannot even rendezvous; above a week is no timeout (and overflows C)
MIN_COMM_TIMEOUT_S, MAX_COMM_TIMEOUT_S = 1.0, 7 * 24 * 3600.0
# sizes refused before anything is allocated (the schedule's own limits are in
# chimera.schedules.registry): a micro-batch is (B, seq_len) tokens on every first stage
LIMITS = {"micro_batch_size": 65536, "data_parallel": 1024, "tensor_parallel": 64,
          "threads": 1024, "eval_batches": 10000,
          "grad_accum": 65536}
RESUME_ALLOWABLE = ("data",)  # refused on --resume unless named in --resume-allow


class ConfigError(UserError):
    """A training configuration that cannot run; the message says what to change."""


def knob(default=None, help: str = "", *, short: str | None = None, metavar: str | None = None,
         default_text: str | None = None):
    """A field with its default and its help, written once (``short``: a one-letter alias;
    ``default_text``: what an unset (None) value means)."""
    meta = {"help": help, "short": short, "metavar": metavar, "default_text": default_text}
    if isinstance(default, (list, dict)):
        raise TypeError("a section's default is immutable")
    return field(default=default, metadata=meta)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _whole(section, name: str, low: int = 1, optional: bool = False) -> None:
    value = getattr(section, name)
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ConfigError(f"{flag(name)} must be {what}, got {value!r}")
    if value > LIMITS.get(name, value):
        raise ConfigError(f"{flag(name)} {value} exceeds the limit of {LIMITS[name]}")


def _real(section, name: str, low: float | None = None, high: float | None = None,
          open_low: bool = False, open_high: bool = False, optional: bool = False) -> None:
    value = getattr(section, name)
    if optional and value is None:
        return
    bad = not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
    bad = bad or (low is not None and (value <= low if open_low else value < low))
    bad = bad or (high is not None and (value >= high if open_high else value > high))
    if bad:
        rng = [f"{'>' if open_low else '>='} {low:g}" if low is not None else "",
               f"{'<' if open_high else '<='} {high:g}" if high is not None else ""]
        raise ConfigError(f"{flag(name)} must be a finite number {' and '.join(r for r in rng if r)}, "
                          f"got {value!r}")


def _kinds(section) -> None:
    """Text, switches and lists of text checked by their annotation (a TOML file may hold any
    type there; numbers and choices are checked field by field, with their ranges)."""
    for f in fields(section):
        value, kind = getattr(section, f.name), f.type.replace(" ", "")
        if value is None and kind.endswith("|None"):
            continue
        kind = kind.removesuffix("|None")
        if kind == "str" and isinstance(value, os.PathLike):  # a path from Python: as its text
            object.__setattr__(section, f.name, value := os.fspath(value))
        if kind == "str" and not isinstance(value, str):
            raise ConfigError(f"{flag(f.name)} must be text, got {value!r}")
        if kind == "bool" and not isinstance(value, bool):
            raise ConfigError(f"{flag(f.name)} must be true or false, got {value!r}")
        if kind == "tuple[str,...]" and not isinstance(value, str) and not (
                isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value)):
            raise ConfigError(f"{flag(f.name)} must be a list of text, got {value!r}")


def _choice(section, name: str, choices) -> None:
    value = getattr(section, name)
    if value not in choices:
        raise ConfigError(f"{flag(name)} must be one of {', '.join(c for c in choices if c)}, "
                          f"got {value!r}")


@dataclass(frozen=True)
class Net:
    """The model: what is trained, at which precision, cut how."""

    model: str = knob("gpt2-tiny", "a preset (gpt2-tiny, gpt2-bench, gpt2-small, gpt2-medium, "
                      "gpt2-paper, bert-tiny, bert-48); a Hugging Face model built from a config (needs "
                      "the hf extra): hf-llama-tiny, hf-qwen2-tiny, hf-mistral-tiny, hf-qwen3-tiny, "
                      "hf-gemma-tiny, hf-phi3-tiny, hf-gpt2-small, or hf:PATH, a config.json or a "
                      "folder holding one (GPT-2, Llama, Qwen2, Mistral, Qwen3, Gemma, Phi-3, "
                      "BERT), whose save_pretrained safetensors, if "
                      "there, are the starting weights. A preset's vocabulary is the data's; an "
                      "hf:PATH config must hold the data's ids", metavar="NAME|hf:PATH")
    seq_len: int | None = knob(None, "tokens per sequence", metavar="T",
                               default_text="the preset's, or an hf:PATH config's max_position_embeddings")
    partition: str | None = knob(None, "layer ranges per stage, e.g. 0-3,4-7; embedding and head count as "
                                 "layers", metavar="RANGES", default_text="balanced by estimated cost")
    dtype: Literal[DTYPES] = knob("float32", "precision: bf16 = float32 weights with bf16 autocast; "
                                  "bf16-master = bf16 weights, gradients and allreduce, with float32 "
                                  "master weights and AdamW state; fp16 = float32 weights with float16 "
                                  "autocast and a dynamic loss scale (a step whose gradients overflow "
                                  "is skipped, the scale halved)")
    wire_dtype: Literal["bf16", "float16"] | None = knob(
        None, "send floating activations and gradients between stages in this dtype (half the "
        "bytes of float32; cast back on arrival)", default_text="as computed")
    freeze: tuple[str, ...] = knob((), "parameters that do not train: globs over model-wide names "
                                   "'<layer>.<name in the layer>' (e.g. '0.*' the embedding, "
                                   "'*.ln_*'); no gradient, no optimizer state, no allreduce",
                                   metavar="PATTERN")
    doc_mask: bool = knob(False, "keep the documents packed into each sequence apart: every "
                          "token attends only to its own document (a block-diagonal causal mask) "
                          "and positions restart at each document, as if each ran alone; "
                          "documents end with the data's end-of-text id (--eos-id); causal "
                          "models only")
    lora_rank: int = knob(0, "LoRA adapters of rank R on --lora-targets, every base weight frozen "
                          "(0: no adapters)", metavar="R")
    lora_alpha: float = knob(16.0, "LoRA's alpha: the adapters' update is scaled by alpha / R",
                             metavar="A")
    lora_targets: tuple[str, ...] = knob((), "the linear layers that get adapters: globs over "
                                         "model-wide module names (e.g. '*.q_proj')", metavar="PATTERN",
                                         default_text="the attention query and value projections: "
                                         "q_proj, v_proj (Llama-like), qkv_proj (Phi-3), c_attn (HF GPT-2), attn.qkv (GPT-2 "
                                         "presets)")

    def __post_init__(self) -> None:
        _kinds(self)
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"--model must be a model name, got {self.model!r}")
        _whole(self, "seq_len", optional=True)
        _choice(self, "dtype", DTYPES)
        _choice(self, "wire_dtype", tuple(WIRE_DTYPES))
        for name in ("freeze", "lora_targets"):  # "a,b" as well as several words
            object.__setattr__(self, name, _patterns(getattr(self, name)))
        _whole(self, "lora_rank", low=0)
        _real(self, "lora_alpha", low=0.0, open_low=True)
        if self.lora_targets and not self.lora_rank:
            raise ConfigError("--lora-targets needs --lora-rank R (the adapters' rank)")

    @property
    def lora(self) -> dict | None:
        """The adapters' settings (``chimera.models.lora.LoRAOptions``'s fields), None without."""
        if not self.lora_rank:
            return None
        return dict(rank=self.lora_rank, alpha=float(self.lora_alpha),
                    targets=list(self.lora_targets) or None)


def _patterns(given) -> tuple[str, ...]:
    given = (given,) if isinstance(given, str) else given
    return tuple(n.strip() for item in given for n in str(item).split(",") if n.strip())


@dataclass(frozen=True)
class Corpus:
    """The data and how to read it (``chimera.data.formats.DataSpec``)."""

    data: str | None = knob(None, "what to train on: a text file or folder (bytes, or --tokenizer "
                            "ids), a .bin token file (--token-dtype), a folder with train.bin [val.bin] "
                            "(from chimera tokenize or nanoGPT), a 1-D integer .npy, a .jsonl "
                            "(--text-field), or a datasets save_to_disk folder (input_ids or a text "
                            "column). Anything else is refused", metavar="FILE|DIR",
                            default_text="the Python standard library's source files, on every machine")
    token_dtype: Literal["uint16", "uint32"] | None = knob(
        None, "width of the ids in a .bin token file (nanoGPT writes uint16); read from meta.json "
        "if it is there")
    vocab_size: int | None = knob(None, "token ids are below V; the model's vocabulary (needed for token "
                                  "files without meta.json or a tokenizer; BERT adds a mask id after "
                                  "it unless the tokenizer has a [MASK] or <mask> token)", metavar="V",
                                  default_text="the data's: meta.json or the tokenizer")
    text_field: str | None = knob(None, "the text of each .jsonl object, or the column of a "
                                  "datasets folder to read as text (a datasets folder's input_ids "
                                  "column is read as ids when there is one)", metavar="NAME",
                                  default_text="text")
    tokenizer: str | None = knob(None, "tokenizer.json (HF tokenizers) that text goes through; "
                                 "chimera tokenize trains one", metavar="FILE",
                                 default_text="text is read as bytes, 256 ids; with --model hf:DIR, "
                                 "DIR/tokenizer.json if there is one")
    val_data: str | None = knob(None, "held-out data for --eval-every, read as --data is (the same "
                                "flags and vocabulary); every document of --data then trains",
                                metavar="FILE|DIR", default_text="documents held out of --data")
    val_fraction: float | None = knob(None, "the share of --data's documents (files of a folder, "
                                      ".jsonl objects, datasets rows, spans of token ids ending "
                                      "in the end-of-text id) held out, a seeded choice of whole "
                                      "documents (one document: its last ids); 0: none",
                                      metavar="F", default_text="0.05")
    data_mix: tuple[str, ...] = knob((), "several training sources instead of --data, each "
                                     "PATH:WEIGHT (a.txt:0.7 b.jsonl:0.3), read as --data is "
                                     "(one vocabulary); each row of a batch comes from a source "
                                     "drawn by weight, seeded by the step", metavar="PATH:W")
    eos_id: int | None = knob(None, "the end-of-text id that ends each document of token ids "
                              "(nanoGPT's GPT-2 files: 50256), for token files without meta.json: "
                              "the held-out split and --doc-mask then go by documents",
                              metavar="ID", default_text="meta.json's or the tokenizer's, else none")

    def spec(self):
        """These fields as a ``chimera.data.formats.DataSpec``."""
        from chimera.data.formats import DataSpec  # lazy: chimera.data imports torch

        return DataSpec(self.data, self.token_dtype, self.vocab_size, self.text_field,
                        self.tokenizer, self.val_data, self.val_fraction, tuple(self.data_mix),
                        self.eos_id)

    def __post_init__(self) -> None:
        _kinds(self)
        try:  # the values of --token-dtype, --vocab-size, --text-field... (no file is read)
            self.spec()
        except UserError as exc:
            raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class Pipeline:
    """The layout and the schedule: D stages, W copies, N micro-batches of B sequences, and
    the scheme's own options (``options``: name -> value, as the registry declares them)."""

    schedule: str = knob("chimera", "a runnable scheme (see `chimera schedules`), or 'none' with "
                         "--stages 1: plain single-process training, the reference", short="-s")
    stages: int = knob(2, "pipeline depth D", short="-D")
    micro_batches: int | None = knob(None, "micro-batches per step N", short="-N",
                                     default_text="2D; 1 for --schedule none")
    micro_batch_size: int = knob(4, "sequences per micro-batch", short="-B")
    data_parallel: int = knob(1, "pipeline copies W", short="-W")
    tensor_parallel: int = knob(1, "tensor-parallel ranks T inside each pipeline rank (one node: "
                                "global rank = (w*D + d)*T + t); every layer sharded by the "
                                "model's plan, W*D*T processes in all", short="-T")
    sync: Literal["eager", "end"] = knob("eager", "when a stage's gradient allreduce starts: eager "
                                         "(right after its last backward, overlapping bubbles) or end")
    recompute: bool = knob(False, "recompute activations in backward")
    shard_optimizer: bool = knob(False, "ZeRO-1 over each stage's replica group: reduce-scatter the "
                                 "gradients, each replica updates its 1/(2W) slice, all-gather the "
                                 "parameters (AdamW state per rank falls by the group size)")
    options: tuple[tuple[str, object], ...] = knob((), "the scheme's options (chimera.schedules."
                                                   "registry), each a flag of its own")

    def __post_init__(self) -> None:
        _kinds(self)
        for name in ("stages", "micro_batch_size", "data_parallel", "tensor_parallel"):
            _whole(self, name)
        _whole(self, "micro_batches", optional=True)
        _choice(self, "sync", ("eager", "end"))
        object.__setattr__(self, "options", _options(self.options))
        if self.reference and (self.stages != 1 or self.data_parallel != 1 or
                               self.tensor_parallel != 1):
            raise ConfigError("--schedule none is single-process training: use --stages 1 "
                              "--data-parallel 1 --tensor-parallel 1")
        if not self.reference and self.stages < 2 and self.schedule != "1f1b":
            raise ConfigError(f"--schedule {self.schedule} needs --stages >= 2 "
                              f"(use --schedule none --stages 1 for single-process training)")
        if not self.reference:
            try:
                require_runnable(self.schedule)
            except ScheduleError as exc:  # an unknown or a simulation-only scheme
                raise ConfigError(str(exc)) from None
        if self.scheme_options.get("strategy") == "halving" and self.micro_batch_size % 2:
            raise ConfigError("backward halving splits each micro-batch in two: "
                              "--micro-batch-size must be even")

    @property
    def reference(self) -> bool:
        return self.schedule == "none"

    @property
    def n_micro(self) -> int:
        return self.micro_batches or default_micro_batches(self.stages, self.schedule)

    @property
    def world(self) -> int:
        return self.data_parallel * self.stages * self.tensor_parallel

    @property
    def scheme_options(self) -> dict:
        """The options given (``build`` checks them against the scheme's declarations)."""
        return dict(self.options)


def _options(given) -> tuple[tuple[str, object], ...]:
    """``options`` as sorted (name, value) pairs without the unset ones; a name no scheme
    declares is refused here, one the scheme does not take by ``build``."""
    pairs = given.items() if isinstance(given, dict) else given
    try:
        pairs = [(k, v) for k, v in pairs if v is not None]
    except (TypeError, ValueError):
        raise ConfigError(f"options must be a dict of scheme options, got {given!r}") from None
    declared = option_declarations()
    unknown = sorted(k for k, _ in pairs if k not in declared)
    if unknown:
        raise ConfigError(f"unknown scheme option(s) {', '.join(map(str, unknown))}; declared: "
                          f"{', '.join(declared)}")
    return tuple(sorted(pairs))


@dataclass(frozen=True)
class Optim:
    """AdamW, its learning rate over the steps, and the batch of a step."""

    steps: int = knob(40, "optimizer steps")
    lr: float = knob(3e-3, "peak learning rate of AdamW")
    warmup: int | None = knob(None, "warm-up steps", default_text="10% of the steps")
    lr_schedule: Literal[LR_SCHEDULES] = knob(
        "cosine", "the learning rate after warm-up: cosine or linear decay to --min-lr-ratio, wsd "
        "(the peak until the last --wsd-decay of the steps, then linear to it), constant")
    min_lr_ratio: float = knob(0.1, "the last learning rate as a fraction of --lr, 0 to 1", metavar="R")
    wsd_decay: float = knob(0.2, "wsd: the fraction of the steps that decays, 0 to 1", metavar="F")
    adam_beta1: float = knob(0.9, "AdamW's first-moment decay, 0 <= B1 < 1", metavar="B1")
    adam_beta2: float = knob(0.95, "AdamW's second-moment decay, 0 <= B2 < 1", metavar="B2")
    adam_eps: float = knob(1e-8, "AdamW's epsilon", metavar="EPS")
    weight_decay: float = knob(0.1, "AdamW's decoupled weight decay of the matrices (embeddings "
                               "included); biases and norms do not decay")
    grad_accum: int = knob(1, "sum the gradients of K mini-batches (each a full pass of the "
                           "schedule) per optimizer step: the step's batch is K*W*N*B sequences, the "
                           "same result as one step on it; --steps counts optimizer steps", metavar="K")
    clip: float = knob(1.0, "global gradient-norm clip (0: off)")
    seed: int = knob(0, "seed of the weights and the order of the data")

    def __post_init__(self) -> None:
        _kinds(self)
        _whole(self, "steps")
        if isinstance(self.lr, (int, float)) and not isinstance(self.lr, bool) \
                and math.isfinite(self.lr) and self.lr <= 0:
            raise ConfigError(f"--lr must be positive, got {self.lr!r}")
        _real(self, "lr", 0.0, open_low=True)
        _real(self, "weight_decay", 0.0)
        _real(self, "clip", 0.0)
        _whole(self, "warmup", low=0, optional=True)
        _choice(self, "lr_schedule", LR_SCHEDULES)
        _real(self, "min_lr_ratio", 0.0, 1.0)
        _real(self, "wsd_decay", 0.0, 1.0)
        _real(self, "adam_beta1", 0.0, 1.0, open_high=True)
        _real(self, "adam_beta2", 0.0, 1.0, open_high=True)
        _real(self, "adam_eps", 0.0, open_low=True)
        _whole(self, "grad_accum")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"--seed must be an integer, got {self.seed!r}")

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else max(1, self.steps // 10)


@dataclass(frozen=True)
class Run:
    """Where and how the ranks run, what they report, and when a step is in doubt."""

    threads: int = knob(1, "torch threads per rank")
    device: Literal[DEVICES] = knob("auto", "cpu, cuda, or auto (cuda when a GPU is visible)")
    backend: str = knob("auto", "torch.distributed backend: auto (gloo on CPU, nccl on CUDA), "
                        "gloo or nccl")
    compile: bool = knob(False, "torch.compile every stage module (in place: parameter names and "
                         "checkpoints unchanged; the first steps compile); needs a C++ compiler "
                         "on CPU (g++, or $CXX) and triton on CUDA, checked before the ranks start")
    comm_timeout: float = knob(300.0, "seconds before a p2p or collective wait of a step becomes "
                               "an error naming the rank, action and peer")
    rendezvous_timeout: float = knob(300.0, "seconds the ranks get to connect at start-up (the "
                                     "process group and its first barrier), apart from "
                                     "--comm-timeout: a loaded machine may take long to start "
                                     "them all")
    emulate_nccl: Literal["pair", "rank", "strict"] | None = knob(
        None, "emulate NCCL's p2p and collective semantics on gloo: pair (a stream per pair of "
        "ranks), rank (one p2p stream per rank) or strict (one stream per rank for p2p and "
        "collectives): an order that would hang on GPUs ends in a timeout naming the rank",
        metavar="MODE", default_text="$CHIMERA_EMULATE_NCCL, else off")
    device_plan: int | None = knob(
        None, "1: take the device path's gradient buckets and reduce-scatters on the CPU too, "
        "so a CPU run issues the collectives a GPU run issues; BYTES > 1: that, with buckets of "
        "BYTES; 0: by the device", metavar="BYTES", default_text="$CHIMERA_DEVICE_PLAN, else 0")
    malloc: Literal["keep", "default"] | None = knob(
        None, "keep: tune glibc's malloc to keep freed memory in each rank (a step reallocates "
        "the same buffers); default: leave it alone", default_text="$CHIMERA_MALLOC, else keep")
    fault: str | None = knob(
        None, "inject faults on purpose (drills), comma-separated: kill:RANK:STEP (SIGKILL at the "
        "step's start, first attempt only), nan:RANK:STEP (NaN gradients), deadlock:RANK (waits "
        "for its last receive first)", metavar="SPEC", default_text="$CHIMERA_FAULT, else none")
    tensorboard: str | None = knob(None, "write TensorBoard event files into DIR (needs the "
                                   "tensorboard package): loss, lr, gradient norm, held-out loss and "
                                   "perplexity, per stage compute and communication time, peak memory "
                                   "per rank, tokens/s and model FLOPs utilization", metavar="DIR")
    peak_flops: float | None = knob(None, "each rank's peak FLOP/s, the denominator of model FLOPs "
                                    "utilization", metavar="FLOP/S", default_text="1e11 on a CPU "
                                    "rank, one AVX2 core; 989e12 on CUDA, an H100's dense bf16")
    log_json: str | None = knob(None, "one JSON object per step: step, loss, ...", metavar="FILE")
    trace: str = knob(os.path.join("out", "train-trace.json"), "Perfetto trace of the measured step "
                      "('' for none)", metavar="FILE")
    png: str = knob(os.path.join("out", "train-timeline.png"), "Gantt chart of the measured step "
                    "('' for none)", metavar="FILE")
    trace_step: int | None = knob(None, "which step is measured for --trace and --png", metavar="STEP",
                                  default_text="the last")
    progress: bool = knob(True, "a progress bar")
    skip_nonfinite: bool = knob(False, "skip (and log) a step whose loss or gradient norm is NaN/inf "
                                "instead of stopping the run")
    skip_limit: int = knob(10, "with --skip-nonfinite, stop (exit 1) after K steps in a row were "
                           "skipped", metavar="K")
    spike_factor: float = knob(2.0, "a step whose loss is above F times the median of the last 32 "
                               "healthy steps (and 1 nat above it) is in doubt: no checkpoint after "
                               "it, and the checkpoint of its weights is passed over by --resume "
                               "(0: only NaN/inf count)", metavar="F")
    eval_every: int = knob(0, "every K steps and at the end, the held-out loss (the last 5% of the "
                           "data): forwards only on every rank, the same value on every layout; in "
                           "the summary, the progress bar, --log-json (val_loss) and --json (0: "
                           "never)", metavar="K")
    eval_batches: int = knob(8, "mini-batches of W*N*B sequences per evaluation, the same ones each "
                             "time", metavar="M")

    def __post_init__(self) -> None:
        for name in ("trace", "png"):  # None: no trace, no picture
            object.__setattr__(self, name, "" if getattr(self, name) is None else getattr(self, name))
        _kinds(self)
        _whole(self, "threads")
        _choice(self, "device", DEVICES)
        for name in ("comm_timeout", "rendezvous_timeout"):
            _real(self, name, 0.0)
            if not MIN_COMM_TIMEOUT_S <= getattr(self, name) <= MAX_COMM_TIMEOUT_S:
                raise ConfigError(f"{flag(name)} must be between {MIN_COMM_TIMEOUT_S:g} and "
                                  f"{MAX_COMM_TIMEOUT_S:g} seconds, got {getattr(self, name)!r}")
        _whole(self, "device_plan", low=0, optional=True)
        for name, choices in (("emulate_nccl", ("pair", "rank", "strict")),
                              ("malloc", ("keep", "default"))):
            if getattr(self, name) is not None:
                _choice(self, name, choices)
        _real(self, "peak_flops", 0.0, open_low=True, optional=True)
        _whole(self, "trace_step", low=0, optional=True)
        k = self.skip_limit
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 10**6:
            raise ConfigError(f"--skip-limit must be a positive integer up to 1000000, got {k!r}")
        f = self.spike_factor
        if not isinstance(f, (int, float)) or not math.isfinite(f) or (f != 0 and f <= 1):
            raise ConfigError(f"--spike-factor must be a finite number > 1, or 0 for no spike "
                              f"rule, got {f!r}")
        _whole(self, "eval_every", low=0)
        _whole(self, "eval_batches")


@dataclass(frozen=True)
class Ckpt:
    """Checkpoints (torch.distributed.checkpoint, keyed by parameter name: resume on another
    D, W or schedule)."""

    checkpoint_dir: str | None = knob(None, "write checkpoints DIR/step-<n> (atomically: complete "
                                      "or absent), always one at the end of the run", metavar="DIR")
    checkpoint_every: int = knob(0, "also every K steps (0: only at the end)", metavar="K")
    keep_checkpoints: int = knob(3, "keep the newest N checkpoints", metavar="N")
    resume: bool = knob(False, "continue from the newest checkpoint in --checkpoint-dir if there is "
                        "one (so the same command restarts a crashed run). Changed flags are named: "
                        "--steps, the optimizer, logging and the layout (same batch) are accepted "
                        "and announced; the model, --seq-len, the batch (W*N*B*K), --seed and "
                        "--data are refused")
    resume_allow: tuple[str, ...] = knob((), "changes --resume accepts that it refuses otherwise, "
                                         "comma-separated: data (train on new data from the "
                                         "checkpoint's weights)",
                                         metavar="FIELDS")

    def __post_init__(self) -> None:
        _kinds(self)
        _whole(self, "checkpoint_every", low=0)
        _whole(self, "keep_checkpoints")
        if self.checkpoint_dir is None and (self.resume or self.checkpoint_every):
            raise ConfigError("--resume and --checkpoint-every need --checkpoint-dir")
        given = (self.resume_allow,) if isinstance(self.resume_allow, str) else self.resume_allow
        names = tuple(n.strip() for item in given for n in str(item).split(",") if n.strip())
        unknown = set(names) - set(RESUME_ALLOWABLE)
        if unknown:
            raise ConfigError(f"--resume-allow takes {', '.join(RESUME_ALLOWABLE)}, got "
                              f"{', '.join(sorted(unknown))}")
        object.__setattr__(self, "resume_allow", names)  # "data,seed" as the flag takes it


SECTIONS = {"net": Net, "corpus": Corpus, "pipeline": Pipeline, "optim": Optim, "run": Run,
            "ckpt": Ckpt}
# the one mapping table: a field's flat name (its flag) -> the section that holds it
FLAT = {f.name: section for section, cls in SECTIONS.items() for f in fields(cls)}
assert len(FLAT) == sum(len(fields(cls)) for cls in SECTIONS.values()), "a field name is in two sections"
