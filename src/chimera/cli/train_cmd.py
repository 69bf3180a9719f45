"""`chimera train`: train a model with any schedule on local processes or under torchrun.

The flags are generated (with tyro) from the fields of ``chimera.train.sections``: a field's
name is its flag, its type gives the choices, its default and help are written there once;
every scheme option the registry declares is a flag too. ``--config FILE.toml`` starts from a
file (``TrainConfig.save_toml`` writes one, every checkpoint holds one); flags override it."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import sys
import typing
import warnings

from chimera.cli.common import UsageError, check_output
from chimera.schedules import schemes
from chimera.schedules.registry import option_declarations
from chimera.train import build
from chimera.train.sections import SECTIONS

DESCRIPTION = ("Train a model (a chimera preset or a Hugging Face GPT-2, Llama or BERT, --model) "
               "with any schedule on torch.distributed. With no arguments: gpt2-tiny with Chimera "
               "on D=2 local processes for a short run, then a summary and a PNG timeline plus a "
               "Perfetto trace of a measured step. Under torchrun (RANK/WORLD_SIZE set) each "
               "process is one rank; otherwise the W*D ranks are spawned locally and rendezvous on "
               "127.0.0.1. Every flag is a field of the run's configuration (chimera.train."
               "sections); --config FILE.toml starts from a file, and flags override it.")
CLI_ONLY = {"config": "a TOML file of the run's configuration, one table per section (net, "
                      "corpus, pipeline, optim, run, ckpt; what every checkpoint's config.toml "
                      "holds); flags given beside it override it",
            "json": "print the run's result as one JSON object"}


def add_parsers(sub) -> None:
    # the flags are tyro's (cmd_train parses them); argparse only routes `train` here
    p = sub.add_parser("train", add_help=False, prefix_chars="\x00",
                       help="train GPT-2 / BERT / a Hugging Face model with a pipeline schedule "
                            "(default: a short Chimera run)")
    p.add_argument("argv", nargs="*")
    p.set_defaults(func=cmd_train)


def _section_type(cls):
    """``cls`` as tyro reads it: the same fields and defaults, with their short flags and
    metavars, and no checks (the section itself checks the parsed values, once)."""
    import tyro  # lazy: only `chimera train` parses with it

    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name == "options":
            continue  # each option is a flag of its own (_options_type)
        meta = f.metadata
        help = meta["help"] + (f" ({_names()})" if f.name == "schedule" else "")
        arg = tyro.conf.arg(aliases=(meta["short"],) if meta["short"] else None,
                            metavar=meta["metavar"], help=help,
                            help_behavior_hint=_hint(meta["default_text"]))
        out.append((f.name, typing.Annotated[hints[f.name], arg], dataclasses.field(default=f.default)))
    return dataclasses.make_dataclass(cls.__name__, out, frozen=True)


def _hint(unset: str | None):
    """'(default: ...)', saying what an unset value means rather than 'None'."""
    return lambda label: f"(default: {unset if label == 'None' and unset else label})"


def _names() -> str:
    return "one of " + ", ".join(["none"] + [s.name for s in schemes(runnable=True)])


def _options_type():
    """One flag per option the registered schemes declare (``chimera.schedules.registry``)."""
    import tyro  # lazy: only `chimera train` parses with it

    out = []
    for opt, owners in option_declarations().values():
        if not opt.flag:
            continue
        kind = typing.Literal[opt.choices] if opt.choices else opt.type
        arg = tyro.conf.arg(aliases=(opt.short,) if opt.short else None, metavar=opt.metavar,
                            help=f"{', '.join(owners)}: {opt.help}",
                            help_behavior_hint=f"(default: {opt.shown_default})")
        out.append((opt.name, typing.Annotated[typing.Optional[kind], arg],
                    dataclasses.field(default=None)))
    return dataclasses.make_dataclass("scheme", out, frozen=True)


def _flags_type():
    import tyro  # lazy: only `chimera train` parses with it

    def arg(name, kind, default, metavar=None):
        return (name, typing.Annotated[kind, tyro.conf.arg(help=CLI_ONLY[name], metavar=metavar)],
                dataclasses.field(default=default))
    parts = [(name, _section_type(cls)) for name, cls in SECTIONS.items()] + [("scheme", _options_type())]
    return dataclasses.make_dataclass("chimera-train", [
        arg("config", typing.Optional[str], None, "FILE.toml"),
        *[(name, kind, dataclasses.field(default=None)) for name, kind in parts],
        arg("json", bool, False)], frozen=True), dict(parts)


def _defaults(flags_type, parts: dict, values: dict, options: dict, config: str | None):
    """The flags' defaults: the sections' defaults, or a --config file's values, unchecked
    (the flags override them first; the sections check what is left)."""
    kw = {name: kind(**{f.name: values.get(f.name, f.default) for f in dataclasses.fields(kind)})
          for name, kind in parts.items() if name != "scheme"}
    known = {f.name for f in dataclasses.fields(parts["scheme"])}
    kw["scheme"] = parts["scheme"](**{k: v for k, v in options.items() if k in known})
    return flags_type(config=config, json=False, **kw)


def _odd_switches(values: dict) -> tuple[dict, dict]:
    """(A --config file's values of switches that are not true or false, every switch's default): tyro
    would make another flag of such a default, so the switch keeps its own default and the
    value is put back after parsing unless a flag changed it (the section refuses it then,
    naming the file's line)."""
    switches = {f.name: f.default for cls in SECTIONS.values() for f in dataclasses.fields(cls)
                if isinstance(f.default, bool)}
    return {k: v for k, v in values.items() if k in switches and not isinstance(v, bool)}, switches


def parse(argv: list[str]):
    """(the run's ``TrainConfig``, the CLI-only values ``{"json": ..., "config": ...}``) from
    ``argv``; ``config``: the --config file read (``chimera.train.config_file.ConfigFile``,
    knowing which of its values the flags left), or None."""
    import tyro  # lazy: only `chimera train` parses with it

    from chimera.train import config_file
    from chimera.train.config import TrainConfig

    config = _config_file(argv)
    source = config_file.read(config) if config is not None else None
    flags_type, parts = _flags_type()
    values, options = (source.values(), source.options()) if source else ({}, {})
    odd, switches = _odd_switches(values)
    default = _defaults(flags_type, parts, {**values, **{k: switches[k] for k in odd}}, options,
                        config)
    settings = dict(args=argv, prog="chimera train", description=DESCRIPTION, default=default,
                    config=(tyro.conf.OmitArgPrefixes,))
    with warnings.catch_warnings():  # a file's value of the wrong type: the sections say so
        warnings.filterwarnings("ignore", "The field .* is annotated with type", UserWarning)
        if "-h" in argv or "--help" in argv:
            flags = tyro.cli(flags_type, **settings)  # prints the help and exits 0
        else:
            flags = _parse_quietly(tyro, flags_type, settings)
    flat = {f.name: getattr(getattr(flags, name), f.name) for name in SECTIONS
            for f in dataclasses.fields(parts[name])}
    flat.update({k: v for k, v in odd.items() if flat[k] == switches[k]})
    options = {**options, **dataclasses.asdict(flags.scheme)}
    source = source.keeping(flat, options) if source else None
    with source.blame() if source else contextlib.nullcontext():
        cfg = TrainConfig(**flat, options=options)
    return cfg, {"json": flags.json, "config": source}


def _config_file(argv: list[str]) -> str | None:
    """``--config FILE`` (or ``--config=FILE``) read before the flags, which override it."""
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--config="):
            return a[len("--config="):]
    return None


def _parse_quietly(tyro, flags_type, settings: dict):
    """tyro's parse with its boxed error made one line (a UsageError: exit 2), unwrapped."""
    err, columns = io.StringIO(), os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100000"  # one line per message in the box
    try:
        with contextlib.redirect_stderr(err):
            return tyro.cli(flags_type, **settings)
    except SystemExit as exc:
        if exc.code:
            raise UsageError(_one_line(err.getvalue())) from None
        raise
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns


def _one_line(text: str) -> str:
    """The message of tyro's boxed error: the lines before its first rule, joined."""
    out = []
    for line in text.splitlines()[1:]:
        line = line.strip().strip("│").strip()
        if line.startswith(("─", "╰")):
            break
        if line:
            out.append(line)
    return " ".join(out) or text.strip() or "bad arguments"


def config_from_args(args: argparse.Namespace):
    """The run's configuration from ``chimera train``'s arguments (``args.argv``), with
    ``--tokenizer`` found beside an ``hf:DIR`` model's weights."""
    cfg, extra = parse(args.argv)
    args.json, args.config_file = extra["json"], extra["config"]
    tokenizer = folder_tokenizer(cfg.net.model, cfg.corpus.data, cfg.corpus.tokenizer)
    return cfg if tokenizer == cfg.corpus.tokenizer else cfg.replace(tokenizer=tokenizer)


TEXT_FORMATS = ("stdlib", "text", "jsonl")


def folder_tokenizer(model: str, data: str | None, tokenizer: str | None) -> str | None:
    """``--tokenizer``, else for text and ``--model hf:DIR`` the folder's own ``tokenizer.json``
    (``chimera export``, ``save_pretrained``): its weights learned those ids, not bytes. Weights
    of more than 256 ids with no tokenizer beside them are refused on text."""
    if tokenizer is not None or not model.startswith("hf:"):
        return tokenizer
    from pathlib import Path

    from chimera.data.formats import DataSpec, detect

    folder = Path(model[len("hf:"):])
    folder = folder.parent if folder.is_file() else folder
    if not folder.is_dir() or detect(DataSpec(data)) not in TEXT_FORMATS:
        return None
    if (folder / "tokenizer.json").is_file():
        print(f"chimera train: reading the text through {folder / 'tokenizer.json'} (the "
              "model's own; --tokenizer overrides)", file=sys.stderr)
        return str(folder / "tokenizer.json")
    if any(folder.glob("*.safetensors")) and _config_vocab(folder) not in (None, 256):
        raise UsageError(f"--model {model} holds trained weights of "
                         f"{_config_vocab(folder)} ids but no tokenizer.json: its ids are not "
                         "bytes; pass the tokenizer it was trained with (--tokenizer FILE)")
    return None


def _config_vocab(folder) -> int | None:
    import json

    try:
        return json.loads((folder / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None  # the model loader says what is wrong with it


def cmd_train(args: argparse.Namespace) -> int:
    import json

    from chimera.train import checkpoint
    from chimera.train.launch import FAILURES, TrainingFailed, launch
    from chimera.train.report import measured_timeline, summary

    cfg = config_from_args(args)
    if cfg.ckpt.checkpoint_dir:  # another live run on it: say so before reading its checkpoints
        from chimera.train.checkpoint.lease import check_free

        check_free(cfg.ckpt.checkpoint_dir)
    with args.config_file.blame() if args.config_file else contextlib.nullcontext():
        build.preflight(cfg)  # every check, before any process starts
    run = cfg.run
    for path, flag in ((run.trace, "--trace"), (run.png, "--png"), (run.log_json, "--log-json")):
        check_output(path, flag)
    check_output(run.tensorboard, "--tensorboard", directory=True)
    checked = cfg.corpus.data is not None or cfg.corpus.tokenizer is not None or run.eval_every
    # the ranks take the checked data (text is tokenized once, here); popped, so no name here
    # keeps it alive for the whole run (launch drops it once the ranks have their own)
    data = [_check_data(cfg) if checked else None]
    _note_mask(cfg)
    _note_init(cfg)
    try:
        result = launch(cfg, data.pop())
    except FAILURES + (TrainingFailed,) as exc:  # a hang, a dead peer, a NaN: no traceback
        if not getattr(exc, "reported", False):
            print(f"chimera train: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # the ranks are stopped; say what is left to resume from
        folder = cfg.ckpt.checkpoint_dir
        newest = checkpoint.latest(folder) if folder else None
        where = f"; newest checkpoint {newest} (continue with --resume)" if newest else ""
        print(f"chimera train: {exc.args[0] if exc.args else 'interrupted'}: every rank stopped{where}",
              file=sys.stderr)
        return 128 + getattr(exc, "signum", 2)
    if not result:  # a non-zero rank under torchrun
        return 0
    if not result["steps"]:
        print(f"nothing to do: the checkpoint in {cfg.ckpt.checkpoint_dir} already covers "
              f"--steps {cfg.optim.steps}")
        return 0
    schedule = None if cfg.reference else build.schedule(cfg)
    if args.json:
        print(json.dumps(result))
    else:
        print(summary(result, schedule))
    timeline = measured_timeline(schedule, result) if schedule is not None else None
    if timeline is not None:
        from chimera.cli.schedule_cmds import _write_pictures

        _write_pictures(timeline, run.png, run.trace, quiet=args.json)
    return 0


def _note_mask(cfg) -> None:
    """BERT on token ids whose tokenizer has no mask token masks with an id appended after
    them (as on byte data with 0xFF): a choice the run makes, so it says so, once."""
    info, mask = build.data_info(cfg), build.mask_id(cfg)
    if mask is None or info.is_bytes or info.mask_id is not None:
        return
    why = (f"{info.tokenizer} has no [MASK] or <mask> token" if info.tokenizer
           else "no tokenizer names a mask token")
    if os.environ.get("RANK", "0") == "0":  # under torchrun: once, not once per process
        where = (f"appended after the data's {info.vocab_size} ids" if mask == info.vocab_size
                 else "the model vocabulary's last id")
        print(f"chimera train: BERT masks with id {mask}, {where} ({why})", file=sys.stderr)


def _note_init(cfg) -> None:
    """An hf:PATH folder without weights trains from HF's initialization: say so (a folder
    whose weights were forgotten must not pass for a fine-tuning run)."""
    model = cfg.net.model
    if not model.startswith("hf:") or getattr(build.model_source(cfg), "weights", None) is not None:
        return
    if os.environ.get("RANK", "0") == "0" and not cfg.ckpt.resume:
        print(f"chimera train: {model} holds no weights (no *.safetensors beside its "
              "config): training from Hugging Face's initialization, seeded by --seed",
              file=sys.stderr)


def _check_data(cfg):
    """Missing, empty, too-short or malformed data, an id outside the vocabulary, and a
    held-out split too short for --eval-every, fail here, not inside a spawned process.
    Returns the data read (a ``Corpus``)."""
    from chimera.data.formats import open_data
    from chimera.train.loop import check_heldout

    model = build.model_source(cfg)
    corpus = open_data(build.data_spec(cfg), seq_len=model.seq_len, progress=cfg.run.progress)
    if cfg.run.eval_every:
        check_heldout(corpus, model.kind, model.seq_len)
    return corpus
