"""``--compile``'s toolchain, checked before any rank starts (``build.preflight``), and a
compile failure inside a rank said in one line.

torch.compile's default backend (inductor) writes C++ for CPU kernels and builds it with the
first compiler of ``torch._inductor.config.cpp.cxx`` that answers ``--version`` (``$CXX``,
else g++; clang++ on macOS); for CUDA kernels it writes Triton, which needs the triton
package and a C compiler for its launchers (``$CC``, else gcc or clang). Without them a run
used to fail at its first forward, in every rank, with a traceback each. The check asks
inductor's own search for the compiler and builds a small program with it; a failure it
cannot foresee (a kernel that does not build) ends the rank with one line
(:func:`explain`), not torch's traceback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from chimera.train.sections import ConfigError

DROP = "or drop --compile"
PROBE = "#include <cmath>\n#include <cstdint>\nint main() { return std::isfinite(1.0) ? 0 : 1; }\n"


class CompileFailed(RuntimeError):
    """torch.compile failed inside a rank; the message is one line naming the cause."""


def check(device_type: str) -> None:
    """ConfigError (one line, naming the cause and the fix) when torch.compile cannot build
    kernels for ``device_type`` ("cpu" or "cuda") on this machine."""
    if device_type == "cuda":
        _check_triton()
    else:
        _check_cxx()


def _check_cxx() -> None:
    try:
        from torch._inductor import config, cpp_builder, exc  # lazy: seconds, only for --compile
    except ImportError as error:  # a build of torch without inductor
        raise ConfigError(f"--compile: this torch has no inductor ({error}) {DROP}") from None

    try:
        cxx = cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        tried = ", ".join(c for c in config.cpp.cxx if c) or "none"
        raise ConfigError(f"--compile: no working C++ compiler (torch.compile builds CPU kernels "
                        f"with the first of {tried} that runs; set by $CXX): install one "
                        f"(e.g. apt-get install g++) {DROP}") from None
    why = _cannot_build(cxx)
    if why:
        raise ConfigError(f"--compile: the C++ compiler {cxx} cannot build a test program "
                        f"({why}): repair or replace it (e.g. apt-get install g++, or set $CXX) "
                        f"{DROP}")


def _cannot_build(cxx: str) -> str | None:
    """Why ``cxx`` fails to build a small C++ program (its first error line), or None."""
    with tempfile.TemporaryDirectory(prefix="chimera-cxx-") as tmp:
        source = Path(tmp) / "probe.cpp"
        source.write_text(PROBE)
        try:
            done = subprocess.run([cxx, str(source), "-o", str(Path(tmp) / "probe")],
                                  capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return str(exc)
    if done.returncode == 0:
        return None
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or [f"exit code {done.returncode}"])[0]


def _check_triton() -> None:
    from torch.utils._triton import has_triton  # lazy: only for --compile

    if not has_triton():
        raise ConfigError("--compile on CUDA: torch.compile writes GPU kernels in Triton and the "
                        f"triton package is missing or cannot use this GPU: pip install triton {DROP}")
    if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):
        raise ConfigError("--compile on CUDA: Triton builds its kernel launchers with a C compiler "
                        f"($CC, else gcc or clang) and none is found: install gcc {DROP}")


def explain(exc: BaseException, where: str = "") -> CompileFailed | None:
    """One line for a torch.compile failure inside a rank, after ``where`` (None: not one)."""
    if "torch._dynamo" not in sys.modules:  # nothing was compiled in this process
        return None
    from torch._dynamo.exc import BackendCompilerFailed  # loaded already (above)

    if not isinstance(exc, BackendCompilerFailed):
        return None
    inner = getattr(exc, "inner_exception", None) or exc
    text = str(inner).strip()
    cause = f"{type(inner).__name__}: {text.splitlines()[0]}" if text else type(inner).__name__
    fix = ("install a C++ compiler (e.g. apt-get install g++, or set $CXX)"
           if type(inner).__name__ in ("InvalidCxxCompiler", "CppCompileError") else "")
    return CompileFailed(f"{where}--compile: torch.compile failed ({cause}): {fix or 'run'} "
                         f"{DROP if fix else 'without --compile'}")
