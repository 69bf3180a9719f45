"""NCCL's p2p semantics emulated on gloo (``CHIMERA_EMULATE_NCCL=pair|rank``).

Not implemented yet: only the switch exists.
"""

from __future__ import annotations

import os

from chimera.runtime.p2p import Transport

MODES = ("pair", "rank")
ENV = "CHIMERA_EMULATE_NCCL"


def transport_from_env(rank: int) -> Transport:
    mode = os.environ.get(ENV, "")
    if not mode:
        return Transport()
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: choose one of {', '.join(MODES)} (or leave it unset)")
    raise NotImplementedError(f"{ENV} is not implemented yet")
