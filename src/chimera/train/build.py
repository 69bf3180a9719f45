"""What a ``TrainConfig`` builds: the schedule, the model source, the data's layout, and the
preflight that checks all of them (and the checkpoint folder) before any process starts.

Each is a function of the config, built once per config object (kept beside it, so a config
handed to a spawned rank carries what was built). A config only checks its own values; what
reads files or builds is here. Bad input found here is a ``ConfigError`` naming the flag;
errors from deeper code that are not bad input propagate as they are.

Imports no torch at module level (``chimera train`` checks flags before torch loads).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from chimera.check.validate import validate
from chimera.errors import UserError
from chimera.ir import Schedule, ScheduleError
from chimera.passes import lower
from chimera.schedules import build as build_scheme
from chimera.train import compiler, resume
from chimera.train.sections import ConfigError


def _cached(cfg, key: str, make):
    """``make()`` once per config object (not a field: not compared, not in its TOML)."""
    built = cfg.__dict__.setdefault("_built", {})
    if key not in built:
        built[key] = make()
    return built[key]


def schedule(cfg) -> Schedule:
    """The lowered, validated schedule (``ConfigError`` on an impossible layout)."""
    def make():
        p = cfg.pipeline
        try:
            s = build_scheme(p.schedule, p.stages, p.n_micro, **p.scheme_options)
        except ScheduleError as exc:
            raise ConfigError(str(exc).splitlines()[0]) from None
        return validate(lower(s, p.sync), p.tensor_parallel)
    return _cached(cfg, "schedule", make)


def stages_total(cfg) -> int:
    """Model pieces: D, or v·D (interleaved), 2D (V placements); 1 for the reference."""
    return 1 if cfg.pipeline.reference else schedule(cfg).stages


def data_spec(cfg):
    """--data and the flags that say how to read it (``chimera.data.formats.DataSpec``)."""
    return _cached(cfg, "data_spec", cfg.corpus.spec)


def data_info(cfg):
    """The format of --data and its vocabulary, found without reading the ids (those are read
    and checked by ``open_data``: in ``chimera train`` before any process starts)."""
    from chimera.data.formats import describe  # lazy: chimera.data imports torch

    def make():
        try:
            return describe(data_spec(cfg))
        except UserError as exc:  # bad data is bad input to the config (anything else: a bug)
            raise ConfigError(str(exc).splitlines()[0]) from None
    return _cached(cfg, "data_info", make)


def model_source(cfg):
    """What ``--model`` builds (``chimera.train.sources``), its vocabulary the data's: a
    chimera preset (plus BERT's mask id on ids) or a Hugging Face model."""
    return _cached(cfg, "model_source", lambda: _open_source(cfg))


def _open_source(cfg):
    import torch  # lazy: this module imports without torch

    from chimera.train.sources import is_hf, open_source  # lazy: it imports torch

    net = cfg.net
    dtype = torch.float64 if net.dtype == "float64" else torch.float32  # bf16: autocast
    try:
        source = open_source(net.model, data_info(cfg), net.seq_len, dtype)
        if net.doc_mask:
            source.keep_documents_apart(_documents_end(cfg))
        return source
    except ImportError as exc:  # the hf extra is missing
        raise ConfigError(f"--model {net.model}: {exc}") from None
    except UserError as exc:
        line = str(exc).splitlines()[0]
        if not line.startswith("--"):
            line = f"--model {net.model}: {line}" if is_hf(net.model) else f"--model: {line}"
        raise ConfigError(line) from None


def _documents_end(cfg) -> int | None:
    """The end-of-text id of --data, or of every --data-mix source (which must agree)."""
    from chimera.data.formats import describe  # lazy: chimera.data imports torch

    spec = data_spec(cfg)
    if not spec.mix:
        return data_info(cfg).eos_id
    ends = {part.path: describe(part).eos_id for part, _ in spec.parts()}
    if len(set(ends.values())) > 1:
        raise UserError("--doc-mask: the --data-mix sources end their documents with different "
                        "ids (" + ", ".join(f"{p}: {e}" for p, e in ends.items()) + ")")
    return next(iter(ends.values()))


def mask_id(cfg) -> int | None:
    """The id BERT masks with (``chimera.data.bert_mask_id``: the tokenizer's mask token, else
    the model vocabulary's last id); None for a causal model."""
    from chimera.data import bert_mask_id  # lazy: chimera.data imports torch

    source = model_source(cfg)
    return bert_mask_id(data_info(cfg), source.vocab_size) if source.kind == "bert" else None


def model_config(cfg):
    """A chimera preset's ``ModelConfig`` with the data's vocabulary (``chimera bench`` reads
    it; the trainer reads ``model_source``, which any model has)."""
    from chimera.train.sources import PresetSource  # lazy: it imports torch

    source = model_source(cfg)
    if not isinstance(source, PresetSource):
        raise ConfigError(f"{cfg.net.model} is not a chimera preset: it has no ModelConfig")
    return source.config


def resume_changes(cfg) -> list[str]:
    """What ``--resume`` found changed and accepts, one line each (after ``preflight``)."""
    return cfg.__dict__.get("_built", {}).get("resume", (None, []))[1]


def resume_from(cfg):
    """The checkpoint ``resume_changes`` were found against (after ``preflight``)."""
    return cfg.__dict__.get("_built", {}).get("resume", (None, []))[0]


def preflight(cfg):
    """Every check that reads files or builds something, so that a run that cannot start fails
    here, before any process starts: --data exists and its format and vocabulary (from layout
    and metadata), the model and its cut into stages, the GPUs, the schedule (built, lowered
    and validated), --compile's compiler, and --checkpoint-dir (writable; its newest
    checkpoint verified for --resume, refused without it). Returns ``cfg``; a second call does nothing."""
    return _cached(cfg, "preflight", lambda: _preflight(cfg))


def _preflight(cfg):
    if cfg.corpus.data is not None:
        _check_data_path(cfg.corpus.data)
    data_info(cfg)
    _check_model(cfg)
    _check_tensor_parallel(cfg)
    _check_gpus(cfg)
    if cfg.run.compile:
        _check_compiler(cfg)
    if not cfg.pipeline.reference:
        schedule(cfg)
    _check_checkpoint_dir(cfg)
    if cfg.run.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard needs the tensorboard package: pip install "
                          "'chimera-pipeline[torch]' (or tensorboard)")
    return cfg


def _check_data_path(data: str) -> None:
    from chimera.data import special_kind  # lazy: chimera.data imports torch

    if not os.path.exists(data):
        raise ConfigError(f"--data {data}: no such file or directory")
    kind = special_kind(Path(data))
    if kind:
        raise ConfigError(f"--data {data} is {kind}: give a regular text file or a directory of them")


def _check_tensor_parallel(cfg) -> None:
    """--tensor-parallel T: the model has a plan and T divides what it shards (heads,
    key/value heads, MLP and projection widths), checked on one layer of each kind built on
    the meta device (nothing allocated), so a bad T is one line before any process starts."""
    t = cfg.pipeline.tensor_parallel
    if t == 1:
        return
    if cfg.net.lora_rank:
        raise ConfigError(f"--lora-rank with --tensor-parallel {t} is not supported: adapters "
                          "are not sharded; train them with -T 1")
    import torch  # lazy: the config checks run before torch loads

    from chimera.tp import resolve  # lazy: imports torch

    source = model_source(cfg)
    plan, seen = source.tp_plan(), set()
    with torch.device("meta"):
        for index in range(source.num_layers):
            layer = source.build_layer(index, cfg.optim.seed)
            if type(layer) in seen:
                continue
            seen.add(type(layer))
            sub = plan(index, layer)
            try:
                if sub:
                    resolve(layer, sub, t)
            except UserError as exc:
                raise ConfigError(f"--tensor-parallel {t}: layer {index} "
                                  f"({type(layer).__name__}): {exc}") from None


def _check_model(cfg) -> None:
    source, model, n = model_source(cfg), cfg.net.model, stages_total(cfg)
    if n > source.num_layers:
        raise ConfigError(f"cannot cut {model} ({source.num_layers} layers: embedding, "
                          f"{source.num_layers - 2} blocks, head) into {n} stages")
    if cfg.net.partition is not None and not cfg.pipeline.reference:
        _check_partition(cfg.net.partition, source.num_layers, n)
    if cfg.pipeline.shard_optimizer and n > 1:
        from chimera.byo import refuse_sharded_ties  # lazy: it imports torch
        from chimera.models.lora import LoRAOptions, Tuning  # lazy: it imports torch

        lora = LoRAOptions(**cfg.net.lora) if cfg.net.lora else None
        trains = Tuning(cfg.net.freeze, lora, cfg.optim.seed, source.ties).trains
        refuse_sharded_ties([source.key(t[0]) for t in source.ties if trains(t[0])],
                            "--shard-optimizer")


def _check_partition(partition: str, n_layers: int, n_stages: int) -> None:
    from chimera.models.partition import parse_partition  # lazy: it imports torch

    try:
        ranges = parse_partition(partition, n_layers)
    except UserError as exc:
        raise ConfigError(f"--partition {partition}: {str(exc).splitlines()[0]}") from None
    if len(ranges) != n_stages:
        raise ConfigError(f"--partition {partition} gives {len(ranges)} stages, the "
                          f"schedule needs {n_stages}")


def _check_gpus(cfg) -> None:
    if cfg.run.device != "cuda":
        return
    import torch  # lazy: this module imports without torch

    if not torch.cuda.is_available():
        raise ConfigError("--device cuda: this torch build has no CUDA or no GPU is visible; "
                          "use --device cpu")
    if cfg.world > torch.cuda.device_count() and "WORLD_SIZE" not in os.environ:
        raise ConfigError(f"--device cuda: the layout needs {cfg.world} GPUs (one per rank), "
                          f"{torch.cuda.device_count()} are visible")


def _check_compiler(cfg) -> None:
    """--compile: the compiler torch.compile needs on the run's device (``train.compiler``)."""
    device = cfg.run.device
    if device == "auto":
        import torch  # lazy: the config checks run before torch loads

        device = "cuda" if torch.cuda.is_available() else "cpu"
    compiler.check(device)


def _check_checkpoint_dir(cfg) -> None:
    folder = cfg.ckpt.checkpoint_dir
    if folder is None:
        return
    where = os.path.abspath(folder)
    if os.path.exists(where) and not os.path.isdir(where):
        raise ConfigError(f"--checkpoint-dir {folder}: exists and is not a directory")
    parent = where
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--checkpoint-dir {folder}: {parent} is not writable")
    if cfg.ckpt.resume:
        _check_resumable(cfg)
    else:
        _check_unowned(folder)


def _check_unowned(folder: str) -> None:
    """A directory holding checkpoints belongs to their run: only --resume continues it."""
    from chimera.train import checkpoint  # lazy: it imports torch
    from chimera.train.checkpoint import lease

    newest = checkpoint.latest(folder)
    if newest is not None:
        raise ConfigError(lease.foreign_message(folder, newest))


def _check_resumable(cfg) -> None:
    from chimera.train import checkpoint  # lazy: it imports torch

    folder = cfg.ckpt.checkpoint_dir
    path, skipped = checkpoint.resumable(folder)
    if path is None and skipped:
        raise ConfigError(f"--resume: every checkpoint in {folder} is in doubt "
                          f"(newest {skipped[0][0].name}: {skipped[0][1]}); move them away "
                          "to start afresh, or resume one by moving the newer ones away")
    if path is None:
        return  # nothing yet: --resume starts from scratch (the same command restarts)
    try:
        meta = checkpoint.verify(path)  # intact; the model is compared field by field below
    except checkpoint.CheckpointError as exc:
        raise ConfigError(f"--resume: {exc}") from None
    _check_changes(cfg, path, meta)
    data, mask = meta.get("data") or {}, mask_id(cfg)
    if "mask_id" in data and data["mask_id"] != mask:  # older checkpoints: no record
        raise ConfigError(f"--resume: checkpoint {path} was trained with mask id "
                          f"{data['mask_id']}, this run's data masks with {mask}: "
                          "resume on the run's data and tokenizer")


def _check_changes(cfg, path, meta: dict) -> None:
    """Refuse what a resume must not change, one line per field; keep what it accepts
    (``resume_changes``) for the launcher to announce."""
    refused, accepted = resume.compare(meta, cfg, model_source(cfg).fingerprint())
    if len(refused) == 1:  # one line, as every refusal of bad input
        raise ConfigError(f"--resume: {path} was written by another run: {refused[0].strip()}; "
                          f"{resume.REFUSES}")
    if refused:
        raise ConfigError("\n".join([f"--resume: {path} was written by a run this one may not "
                                      f"continue; what differs:", *refused, resume.SUMMARY]))
    cfg.__dict__.setdefault("_built", {})["resume"] = (path, accepted)
