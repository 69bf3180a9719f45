"""`chimera train`: train a model with any schedule on local processes or under torchrun."""

from __future__ import annotations

import argparse
import os
import sys

from chimera.cli.common import (UsageError, add_scheme_options, check_output, nonneg_float, nonneg_int,
                                positive_int, scheme_options_from_args)
from chimera.cli.common import beta_float, positive_float, resume_fields, unit_float
from chimera.passes import SYNC_MODES
from chimera.schedules import schemes

MODELS = ("gpt2-tiny", "gpt2-bench", "gpt2-small", "gpt2-medium", "gpt2-paper", "bert-tiny", "bert-48")
HF_MODELS = ("hf-llama-tiny", "hf-gpt2-small")  # chimera.train.sources.HF_PRESETS (no torch here)


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "train", help="train GPT-2 / BERT / a Hugging Face model with a pipeline schedule "
                      "(default: a short Chimera run)",
        description="Train a model (a chimera preset or a Hugging Face GPT-2, Llama or BERT, "
                    "--model) with any schedule on torch.distributed. With no arguments: "
                    "gpt2-tiny with Chimera on D=2 local processes for a short run, then a summary "
                    "and a PNG timeline plus a Perfetto trace of a measured step. Under torchrun "
                    "(RANK/WORLD_SIZE set) each process is one rank; otherwise the W*D ranks are "
                    "spawned locally and rendezvous on 127.0.0.1.")
    names = ", ".join(["none"] + [s.name for s in schemes(runnable=True)])
    m = p.add_argument_group("model and data")
    m.add_argument("--model", default="gpt2-tiny", metavar="NAME|hf:PATH",
                   help=f"a preset: {', '.join(MODELS)}; a Hugging Face model built from a config "
                        f"(needs the hf extra): {', '.join(HF_MODELS)}, or hf:PATH, a config.json or "
                        "a folder holding one (GPT-2, Llama, BERT), whose save_pretrained "
                        "safetensors, if there, are the starting weights. A preset's vocabulary is "
                        "the data's; an hf:PATH config must hold the data's ids (default: gpt2-tiny)")
    m.add_argument("--seq-len", type=positive_int, metavar="T", help="tokens per sequence "
                   "(default: the preset's, or an hf:PATH config's max_position_embeddings)")
    m.add_argument("--data", metavar="FILE|DIR", help="what to train on: a text file or folder "
                   "(bytes, or --tokenizer ids), a .bin token file (--token-dtype), a folder with "
                   "train.bin [val.bin] (from chimera tokenize or nanoGPT), a 1-D integer .npy, a "
                   ".jsonl (--text-field), or a datasets save_to_disk folder (input_ids or a text "
                   "column). Anything else is refused. Default: the Python standard library's "
                   "source files, on every machine")
    m.add_argument("--token-dtype", choices=("uint16", "uint32"), help="width of the ids in a "
                   ".bin token file (nanoGPT writes uint16); read from meta.json if it is there")
    m.add_argument("--vocab-size", type=positive_int, metavar="V", help="token ids are below V; "
                   "the model's vocabulary (default: the data's: meta.json or the tokenizer; "
                   "needed for token files without either; BERT adds a mask id after it unless the "
                   "tokenizer has a [MASK] or <mask> token)")
    m.add_argument("--text-field", metavar="NAME", help="the text of each .jsonl object, or the "
                   "column of a datasets folder to read as text (default: text; a datasets "
                   "folder's input_ids column is read as ids when there is one)")
    m.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json (HF tokenizers) that text "
                   "goes through (default: text is read as bytes, 256 ids; with --model hf:DIR, "
                   "DIR/tokenizer.json if there is one); chimera tokenize trains one")
    m.add_argument("--dtype", choices=("float32", "float64", "bf16", "bf16-master", "fp16"),
                   default="float32",
                   help="precision: bf16 = float32 weights with bf16 autocast; bf16-master = bf16 "
                        "weights, gradients and allreduce, with float32 master weights and AdamW "
                        "state; fp16 = float32 weights with float16 autocast and a dynamic loss "
                        "scale (a step whose gradients overflow is skipped, the scale halved). "
                        "Default: float32")
    m.add_argument("--wire-dtype", choices=("bf16", "float16"), default=None,
                   help="send floating activations and gradients between stages in this dtype "
                        "(half the bytes of float32; cast back on arrival). Default: as computed")
    m.add_argument("--partition", metavar="RANGES", help="layer ranges per stage, e.g. 0-3,4-7 "
                   "(default: balanced by estimated cost; embedding and head count as layers)")
    s = p.add_argument_group("layout and schedule")
    s.add_argument("--schedule", "-s", default="chimera", help=f"{names} (default: chimera; "
                   "'none' with --stages 1 is plain single-process training, the reference)")
    s.add_argument("--stages", "-D", type=positive_int, default=2, help="pipeline depth D (default: 2)")
    s.add_argument("--micro-batches", "-N", type=positive_int, help="micro-batches per step N (default: 2D)")
    s.add_argument("--micro-batch-size", "-B", type=positive_int, default=4, help="sequences per micro-batch")
    s.add_argument("--data-parallel", "-W", type=positive_int, default=1, help="pipeline copies W (default: 1)")
    add_scheme_options(s)
    s.add_argument("--sync", choices=SYNC_MODES, default="eager", help="gradient allreduce start")
    s.add_argument("--recompute", action="store_true", help="recompute activations in backward")
    s.add_argument("--shard-optimizer", action="store_true",
                   help="ZeRO-1 over each stage's replica group: reduce-scatter the gradients, "
                        "each replica updates its 1/(2W) slice, all-gather the parameters "
                        "(AdamW state per rank falls by the group size)")
    o = p.add_argument_group("optimization")
    o.add_argument("--steps", type=positive_int, default=40, help="optimizer steps (default: 40)")
    o.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of AdamW (default: 3e-3)")
    o.add_argument("--warmup", type=nonneg_int, help="warm-up steps (default: 10%% of the steps)")
    o.add_argument("--lr-schedule", choices=("cosine", "linear", "wsd", "constant"),
                   default="cosine", help="the learning rate after warm-up: cosine or linear decay "
                   "to --min-lr-ratio, wsd (the peak until the last --wsd-decay of the steps, then "
                   "linear to it), constant (default: cosine)")
    o.add_argument("--min-lr-ratio", type=unit_float, default=0.1, metavar="R",
                   help="the last learning rate as a fraction of --lr, 0 to 1 (default: 0.1)")
    o.add_argument("--wsd-decay", type=unit_float, default=0.2, metavar="F",
                   help="wsd: the fraction of the steps that decays, 0 to 1 (default: 0.2)")
    o.add_argument("--adam-beta1", type=beta_float, default=0.9, metavar="B1",
                   help="AdamW's first-moment decay, 0 <= B1 < 1 (default: 0.9)")
    o.add_argument("--adam-beta2", type=beta_float, default=0.95, metavar="B2",
                   help="AdamW's second-moment decay, 0 <= B2 < 1 (default: 0.95)")
    o.add_argument("--adam-eps", type=positive_float, default=1e-8, metavar="EPS",
                   help="AdamW's epsilon (default: 1e-8)")
    o.add_argument("--weight-decay", type=nonneg_float, default=0.1,
                   help="AdamW's decoupled weight decay of the matrices (embeddings included); "
                        "biases and norms do not decay (default: 0.1)")
    o.add_argument("--grad-accum", type=positive_int, default=1, metavar="K",
                   help="sum the gradients of K mini-batches (each a full pass of the schedule) "
                        "per optimizer step: the step's batch is K*W*N*B sequences, the same "
                        "result as one step on it; --steps counts optimizer steps (default: 1)")
    o.add_argument("--clip", type=nonneg_float, default=1.0, help="global grad-norm clip (0: off)")
    o.add_argument("--seed", type=int, default=0)
    r = p.add_argument_group("running and output")
    r.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank (default: 1)")
    r.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    r.add_argument("--compile", action="store_true", help="torch.compile every stage module "
                   "(in place: parameter names and checkpoints unchanged; the first steps compile)")
    r.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard event files into DIR "
                   "(needs the tensorboard package): loss, lr, gradient norm, held-out loss and "
                   "perplexity, per stage compute and communication time, peak memory per rank, "
                   "tokens/s and model FLOPs utilization")
    r.add_argument("--peak-flops", type=positive_float, metavar="FLOP/S",
                   help="each rank's peak FLOP/s, the denominator of model FLOPs utilization "
                        "(default: 1e11 on a CPU rank, one AVX2 core; 989e12 on CUDA, an H100's "
                        "dense bf16)")
    r.add_argument("--comm-timeout", type=float, default=300.0, help="seconds before a p2p or "
                   "collective wait becomes an error naming the rank, action and peer")
    r.add_argument("--log-json", metavar="FILE", help="one JSON object per step: step, loss, ...")
    r.add_argument("--trace", metavar="FILE", default=os.path.join("out", "train-trace.json"),
                   help="Perfetto trace of the measured step (default: out/train-trace.json)")
    r.add_argument("--png", metavar="FILE", default=os.path.join("out", "train-timeline.png"),
                   help="Gantt chart of the measured step (default: out/train-timeline.png)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--skip-nonfinite", action="store_true", help="skip (and log) a step whose "
                   "loss or gradient norm is NaN/inf instead of stopping the run")
    r.add_argument("--skip-limit", type=positive_int, default=10, metavar="K",
                   help="with --skip-nonfinite, stop (exit 1) after K steps in a row were "
                        "skipped (default: 10)")
    r.add_argument("--spike-factor", type=nonneg_float, default=2.0, metavar="F",
                   help="a step whose loss is above F times the median of the last 32 healthy "
                        "steps (and 1 nat above it) is in doubt: no checkpoint after it, and "
                        "the checkpoint of its weights is passed over by --resume (default: 2; "
                        "0: only NaN/inf count)")
    e = p.add_argument_group("evaluation (the held-out split: the last 5% of the data)")
    e.add_argument("--eval-every", type=nonneg_int, default=0, metavar="K",
                   help="every K steps and at the end, the held-out loss: forwards only on every "
                        "rank (eval mode, no gradients, training unchanged), the same value on "
                        "every layout; in the summary, the progress bar, --log-json "
                        "(val_loss) and --json (default: 0, never)")
    e.add_argument("--eval-batches", type=positive_int, default=8, metavar="M",
                   help="mini-batches of W*N*B sequences per evaluation, the same ones each "
                        "time (default: 8)")
    c = p.add_argument_group("checkpoints (torch.distributed.checkpoint, keyed by parameter name: "
                             "resume on another D, W or schedule)")
    c.add_argument("--checkpoint-dir", metavar="DIR", help="write checkpoints DIR/step-<n> "
                   "(atomically: complete or absent), always one at the end of the run")
    c.add_argument("--checkpoint-every", type=nonneg_int, default=0, metavar="K",
                   help="also every K steps (default: 0, only at the end)")
    c.add_argument("--keep-checkpoints", type=positive_int, default=3, metavar="N",
                   help="keep the newest N checkpoints (default: 3)")
    c.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in "
                   "--checkpoint-dir if there is one (so the same command restarts a crashed run). "
                   "Changed flags are named: --steps, the optimizer, logging and the layout (same "
                   "batch) are accepted and announced; the model, --seq-len, the batch (W*N*B*K), "
                   "--seed and --data are refused")
    c.add_argument("--resume-allow", type=resume_fields, default=(), metavar="FIELDS",
                   help="changes --resume accepts that it refuses otherwise, comma-separated: "
                        "data (train on new data from the checkpoint's weights)")
    r.add_argument("--json", action="store_true", help="print the run's result as one JSON object")
    p.set_defaults(func=cmd_train)


def config_from_args(args: argparse.Namespace):
    from chimera.train.config import TrainConfig

    # scheme options TrainConfig names as fields (pipes, chunks, strategy), the rest in options
    given = {k: v for k, v in scheme_options_from_args(args).items() if v is not None}
    named = {k: v for k, v in given.items() if k in TrainConfig.option_fields()}
    others = {k: v for k, v in given.items() if k not in named}
    return TrainConfig(**named, **_knobs(args), options=others or None,
        model=args.model, schedule=args.schedule, stages=args.stages,
        micro_batches=args.micro_batches, micro_batch_size=args.micro_batch_size,
        data_parallel=args.data_parallel, steps=args.steps, lr=args.lr, warmup=args.warmup,
        weight_decay=args.weight_decay, clip=args.clip, seed=args.seed, recompute=args.recompute,
        shard_optimizer=args.shard_optimizer,
        sync=args.sync,
        partition=args.partition, seq_len=args.seq_len, data=args.data, token_dtype=args.token_dtype,
        vocab_size=args.vocab_size, text_field=args.text_field, tokenizer=folder_tokenizer(args),
        dtype=args.dtype, wire_dtype=args.wire_dtype, threads=args.threads,
        comm_timeout=args.comm_timeout, device=args.device, log_json=args.log_json,
        trace=args.trace, png=args.png, progress=not args.no_progress,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints, resume=args.resume,
        skip_nonfinite=args.skip_nonfinite, skip_limit=args.skip_limit,
        spike_factor=args.spike_factor, eval_every=args.eval_every,
        eval_batches=args.eval_batches)


TEXT_FORMATS = ("stdlib", "text", "jsonl")


def folder_tokenizer(args: argparse.Namespace) -> str | None:
    """``--tokenizer``, else for text and ``--model hf:DIR`` the folder's own ``tokenizer.json``
    (``chimera export``, ``save_pretrained``): its weights learned those ids, not bytes. Weights
    of more than 256 ids with no tokenizer beside them are refused on text."""
    if args.tokenizer is not None or not args.model.startswith("hf:"):
        return args.tokenizer
    from pathlib import Path

    from chimera.data.formats import DataSpec, detect

    folder = Path(args.model[len("hf:"):])
    folder = folder.parent if folder.is_file() else folder
    if not folder.is_dir() or detect(DataSpec(args.data)) not in TEXT_FORMATS:
        return None
    if (folder / "tokenizer.json").is_file():
        print(f"chimera train: reading the text through {folder / 'tokenizer.json'} (the "
              "model's own; --tokenizer overrides)", file=sys.stderr)
        return str(folder / "tokenizer.json")
    if any(folder.glob("*.safetensors")) and _config_vocab(folder) not in (None, 256):
        raise UsageError(f"--model {args.model} holds trained weights of "
                         f"{_config_vocab(folder)} ids but no tokenizer.json: its ids are not "
                         "bytes; pass the tokenizer it was trained with (--tokenizer FILE)")
    return None


def _config_vocab(folder) -> int | None:
    import json

    try:
        return json.loads((folder / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None  # the model loader says what is wrong with it


def _knobs(args: argparse.Namespace) -> dict:
    """The optimizer, precision and monitoring flags of issue 25, as TrainConfig fields."""
    names = ("lr_schedule", "min_lr_ratio", "wsd_decay", "adam_beta1", "adam_beta2", "adam_eps",
             "grad_accum", "compile", "tensorboard", "peak_flops", "resume_allow")
    return {name: getattr(args, name) for name in names}


def cmd_train(args: argparse.Namespace) -> int:
    import json

    from chimera.train import checkpoint
    from chimera.train.launch import FAILURES, TrainingFailed, launch
    from chimera.train.report import measured_timeline, summary

    if args.checkpoint_dir:  # another live run on it: say so before reading its checkpoints
        from chimera.train.checkpoint.lease import check_free

        check_free(args.checkpoint_dir)
    cfg = config_from_args(args).preflight()  # every check, before any process starts
    for path, flag in ((cfg.trace, "--trace"), (cfg.png, "--png"), (cfg.log_json, "--log-json")):
        check_output(path, flag)
    check_output(cfg.tensorboard, "--tensorboard", directory=True)
    checked = args.data is not None or args.tokenizer is not None or cfg.eval_every
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
        newest = checkpoint.latest(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
        where = f"; newest checkpoint {newest} (continue with --resume)" if newest else ""
        print(f"chimera train: {exc.args[0] if exc.args else 'interrupted'}: every rank stopped{where}",
              file=sys.stderr)
        return 128 + getattr(exc, "signum", 2)
    if not result:  # a non-zero rank under torchrun
        return 0
    if not result["steps"]:
        print(f"nothing to do: the checkpoint in {cfg.checkpoint_dir} already covers "
              f"--steps {cfg.steps}")
        return 0
    schedule = None if cfg.reference else cfg.build_schedule()
    if args.json:
        print(json.dumps(result))
    else:
        print(summary(result, schedule))
    timeline = measured_timeline(schedule, result) if schedule is not None else None
    if timeline is not None:
        from chimera.cli.schedule_cmds import _write_pictures

        _write_pictures(timeline, cfg.png, cfg.trace, quiet=args.json)
    return 0


def _note_mask(cfg) -> None:
    """BERT on token ids whose tokenizer has no mask token masks with an id appended after
    them (as on byte data with 0xFF): a choice the run makes, so it says so, once."""
    info = cfg.data_info
    if cfg.mask_id is None or info.is_bytes or info.mask_id is not None:
        return
    why = (f"{info.tokenizer} has no [MASK] or <mask> token" if info.tokenizer
           else "no tokenizer names a mask token")
    if os.environ.get("RANK", "0") == "0":  # under torchrun: once, not once per process
        where = (f"appended after the data's {info.vocab_size} ids" if cfg.mask_id == info.vocab_size
                 else "the model vocabulary's last id")
        print(f"chimera train: BERT masks with id {cfg.mask_id}, {where} ({why})", file=sys.stderr)


def _note_init(cfg) -> None:
    """An hf:PATH folder without weights trains from HF's initialization: say so (a folder
    whose weights were forgotten must not pass for a fine-tuning run)."""
    if not cfg.model.startswith("hf:") or getattr(cfg.model_source, "weights", None) is not None:
        return
    if os.environ.get("RANK", "0") == "0" and not cfg.resume:
        print(f"chimera train: {cfg.model} holds no weights (no *.safetensors beside its "
              "config): training from Hugging Face's initialization, seeded by --seed",
              file=sys.stderr)


def _check_data(cfg):
    """Missing, empty, too-short or malformed data, an id outside the vocabulary, and a
    held-out split too short for --eval-every, fail here, not inside a spawned process.
    Returns the data read (a ``Corpus``)."""
    from chimera.data.formats import open_data
    from chimera.train.loop import check_heldout

    model = cfg.model_source
    corpus = open_data(cfg.data_spec, seq_len=model.seq_len, progress=cfg.progress)
    if cfg.eval_every:
        check_heldout(corpus, model.kind, model.seq_len)
    return corpus
