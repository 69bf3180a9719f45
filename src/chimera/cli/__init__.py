"""The `chimera` command line: thin argument parsing over the library.

Each sub-command lives in its own module with ``add_parser(subparsers)`` registering it and
setting ``func``. Bad input (a :class:`chimera.errors.UserError`) exits with code 2 and one
line on stderr (plus the grid of a schedule error). Anything else is a bug in the library: it
propagates, so Python prints its traceback and exits with code 1.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import sys

from chimera.cli.common import fail
from chimera.errors import UserError

COMMANDS = ("chimera.cli.schedule_cmds",)
OPTIONAL_COMMANDS = ("chimera.cli.train_cmd", "chimera.cli.generate_cmd", "chimera.cli.export_cmd",
                     "chimera.cli.judge_cmd",
                     "chimera.cli.bench_cmd",
                     "chimera.cli.plan_cmd", "chimera.cli.profile_cmd", "chimera.cli.tokenize_cmd")


# What the machine refuses while a command writes (a full or read-only disk, a quota, an I/O
# error): one line and exit code 1, not a traceback. Outputs are checked before the work
# (``check_output``); these can only happen during it.
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO}


def _environment_failure(exc: OSError) -> str | None:
    """The line for a write the machine refused, or None (then it is a bug: a traceback)."""
    if exc.errno in _ENVIRONMENT_ERRNOS:
        return f"{exc.strerror}" + (f" ({exc.filename})" if exc.filename else "")
    if exc.errno is None and "written" in str(exc):  # numpy's tofile: "N requested and M written"
        return f"a write stopped short ({exc}): is the disk full?"
    return None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        fail(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="chimera",
        description="Chimera bidirectional pipeline parallelism: build, check, simulate, draw and "
                    "run pipeline schedules. Try `chimera show` or `chimera demo`.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(name).add_parsers(sub)
    for name in OPTIONAL_COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        fail(f"chimera {args.command}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
             detail=str(exc))
    except BrokenPipeError:
        return 0
    except OSError as exc:
        why = _environment_failure(exc)
        if why is None:
            raise
        print(f"chimera {args.command}: {why}", file=sys.stderr)
        return 1  # a failure at run time, not bad input: the same command may work later
    except KeyboardInterrupt as exc:  # every rank a launcher started is stopped by now
        signum = getattr(exc, "signum", 2)
        print(f"chimera {args.command}: {exc.args[0] if exc.args else 'interrupted'}", file=sys.stderr)
        return 128 + signum
    return 0
