"""Keep freed CPU memory in the process: a pipeline step reallocates the same buffers.

glibc's malloc hands blocks over a threshold back to the kernel when they are freed (mmap /
trim), so the next step's activations and gradients of the same sizes come back as fresh
pages and every first touch page-faults. A pipeline makes that worse than plain training:
split backward keeps the gradients at its boundaries until W, so I cannot reuse their
buffers. Measured here (gpt2-bench, 4 blocks, micro-batch 2, one thread,
`python benchmarks/split_backward.py [--default-malloc]`): I + W went from 1.25 B to 1.11 B.
PyTorch's CPU performance guide recommends jemalloc or tcmalloc for the same reason; this
gets most of it from glibc alone. The cost is that a rank's RSS stays at its peak, which a
training step reaches every iteration anyway. The setting is process-wide: the training
entry points call it in the process that trains (a spawned or torchrun rank, a `--schedule
none` run, `chimera.api.Pipeline`); ``--malloc default`` (``CHIMERA_MALLOC=default``, the run
context's ``RuntimeOptions.malloc``) turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
TRIM_THRESHOLD = 1 << 30  # never give the heap's top back below 1 GiB of free space
TOP_PAD = 64 << 20  # grow the heap in 64 MiB steps
MMAP_THRESHOLD = 32 << 20  # blocks under 32 MiB (glibc's maximum) come from the heap

_done: bool | None = None


def keep_freed_memory(mode: str = "keep") -> bool:
    """Tune glibc's malloc for this process (once) unless ``mode`` is ``default``; False
    where it does not apply."""
    global _done
    if _done is not None:
        return _done
    if mode == "default":
        return False
    _done = False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl without mallopt)
        return False
    _done = all(mallopt(p, v) == 1 for p, v in ((M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                                                 (M_TOP_PAD, TOP_PAD),
                                                 (M_MMAP_THRESHOLD, MMAP_THRESHOLD)))
    return _done
