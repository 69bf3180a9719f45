"""Shared pieces of the CLI: failing cleanly, schedule options, argument types."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

from chimera.errors import UserError
from chimera.ir import Schedule
from chimera.passes import SYNC_MODES, lower
from chimera.schedules import build, default_micro_batches, get_scheme, schemes
from chimera.schedules.registry import option_declarations
from chimera.check.validate import validate


class UsageError(UserError):
    """A bad combination of flags: reported as one line, exit code 2."""


def fail(message: str, detail: str | None = None) -> None:
    """Print one line (plus an optional picture for schedule errors) and exit with code 2."""
    print(message, file=sys.stderr)
    if detail and "\n" in detail:
        print("\n".join(detail.splitlines()[1:]), file=sys.stderr)
    raise SystemExit(2)


def check_output(path: str | None, flag: str, directory: bool = False) -> None:
    """Refuse an output path that could not be written, before any work is done: a result
    must never be lost after the work (UsageError)."""
    if not path:
        return
    where = os.path.abspath(path)
    if directory and os.path.exists(where) and not os.path.isdir(where):
        raise UsageError(f"{flag} {path}: exists and is not a directory")
    if not directory and os.path.isdir(where):
        raise UsageError(f"{flag} {path}: is a directory, not a file")
    if not directory and os.path.exists(where) and not os.access(where, os.W_OK):
        raise UsageError(f"{flag} {path}: exists and is not writable")
    folder = where if directory else os.path.dirname(where)
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"{flag} {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: {existing} is not writable")
    _try_writing_in(existing, flag, path)


def _try_writing_in(folder: str, flag: str, path: str) -> None:
    """os.access says yes to root everywhere, and /proc or /sys refuse even root: make (and
    drop) a nameless file there, as the command will make its output."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write in {folder}: {exc.strerror or exc}") from None


def _whole(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _whole(text, 1, "a positive integer")


def nonneg_int(text: str) -> int:
    return _whole(text, 0, "an integer >= 0")


def _real(text: str, ok, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def nonneg_float(text: str) -> float:
    return _real(text, lambda v: v >= 0, "a finite number >= 0")


def positive_float(text: str) -> float:
    return _real(text, lambda v: v > 0, "a finite number > 0")




def add_checkpoint_input(p: argparse.ArgumentParser, served: bool = True) -> None:
    """``--checkpoint``, as every command that reads a trained model takes it; ``served``: the
    command hands the model to the user (``--allow-in-doubt``, ``checkpoint.serve``)."""
    if not served:
        p.add_argument("--checkpoint", required=True, metavar="DIR",
                       help="a run's --checkpoint-dir or one of its step-<n> folders")
        return
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="a run's --checkpoint-dir (its newest healthy step-<n>, naming newer ones "
                        "passed over) or one step-<n> folder (refused unless healthy)")
    p.add_argument("--allow-in-doubt", action="store_true",
                   help="use a checkpoint in doubt or not judged yet anyway (a run's folder: its "
                        "newest), with a warning; `chimera judge` gives an unjudged one its verdict")


def add_folder_output(p: argparse.ArgumentParser) -> None:
    """``--out`` of a command that writes a folder atomically (check it with ``check_output``)."""
    p.add_argument("--out", required=True, metavar="DIR",
                   help="folder to write (must not exist or be empty); it appears complete or not at all")


def add_schedule_options(p: argparse.ArgumentParser, default: str = "chimera",
                         stages: int = 4, micro_batches: int | None = None) -> None:
    names = [s.name for s in schemes()]
    g = p.add_argument_group("schedule")
    g.add_argument("--schedule", "-s", default=default, metavar="NAME",
                   help=f"scheme: {', '.join(names)} (default: {default}; see `chimera schedules`)")
    g.add_argument("--stages", "-D", type=positive_int, default=stages,
                   help=f"pipeline depth D = ranks per pipeline (default: {stages})")
    g.add_argument("--micro-batches", "-N", type=positive_int, default=micro_batches,
                   help="micro-batches per iteration N (default: 2D, as chimera train and the API)")
    add_scheme_options(g)
    g.add_argument("--sync", choices=SYNC_MODES, default="eager",
                   help="when a stage's gradient allreduce starts: eager (right after its last "
                        "backward, overlapping bubbles) or end (default: eager)")


def add_scheme_options(group) -> None:
    """One flag per option the registered schemes declare (``chimera.schedules.registry``)."""
    for opt, owners in option_declarations().values():
        if not opt.flag:
            continue
        flags = [f"--{opt.name.replace('_', '-')}"] + ([opt.short] if opt.short else [])
        kind = {"choices": opt.choices} if opt.choices else {
            "type": positive_int if opt.type is int and opt.low == 1 else
            nonneg_int if opt.type is int else opt.type}
        group.add_argument(*flags, default=None, metavar=opt.metavar, **kind,
                           help=f"{', '.join(owners)}: {opt.help} (default: {opt.shown_default})")


def scheme_options_from_args(args: argparse.Namespace, scheme: str | None = None) -> dict:
    """Every scheme option's flag (unset: None; ``build`` refuses one the scheme does not
    take), and the options the command sets otherwise that ``scheme`` takes (``cost``)."""
    out = {name: getattr(args, name, None) for name, (opt, _) in option_declarations().items()
           if opt.flag}
    if scheme is not None:  # time-aware schemes (chimera-zb): the costs they will be simulated with
        out.update({o.name: getattr(args, o.name, None) for o in get_scheme(scheme).declared
                    if not o.flag})
    return out


def schedule_from_args(args: argparse.Namespace) -> Schedule:
    """Build, lower and validate the schedule the options describe (with ``--tensor-parallel``
    where the command has it: the order checked with T ranks per pipeline rank)."""
    n = args.micro_batches or default_micro_batches(args.stages, args.schedule)
    schedule = build(args.schedule, args.stages, n, **scheme_options_from_args(args, args.schedule))
    return validate(lower(schedule, args.sync), getattr(args, "tensor_parallel", 1))
