"""Where a benchmark script writes: ``--out DIR`` if given, else ``out/`` of the current folder.

benchmarks/results/ holds the committed figures the README and RESULTS.md quote; a script
rewrites them only when told to (``--out benchmarks/results``), never by default. ``--out``
is taken out of ``sys.argv`` here, before the script's own parsing sees the rest.
"""

from __future__ import annotations

import sys

DEFAULT = "out"


def out_dir(argv: list[str] | None = None) -> str:
    """The folder named by ``--out DIR`` (or ``--out=DIR``) in ``argv`` (default: sys.argv,
    from which it is removed), else ``out``."""
    argv = sys.argv if argv is None else argv
    for i, word in enumerate(argv):
        if word == "--out" and i + 1 < len(argv):
            folder = argv[i + 1]
            del argv[i:i + 2]
            return folder
        if word.startswith("--out="):
            del argv[i]
            return word.split("=", 1)[1]
    return DEFAULT
