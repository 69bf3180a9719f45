"""The package's source files for the tests that read them as code (the import layers, the
transport's call sites): each file parsed once per test process, not once per test."""

from __future__ import annotations

import ast
import functools
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "chimera"


def package_files() -> list[pathlib.Path]:
    """Every module of the package, in path order."""
    return sorted(PACKAGE.rglob("*.py"))


@functools.cache
def tree(path: pathlib.Path) -> ast.Module:
    """The parsed source of ``path`` (read once; the tests only walk it)."""
    return ast.parse(path.read_text())
