"""The run context: what a run is given once, where it starts, and hands down.

A :class:`RunContext` is made once per process and run (``chimera train``'s launch builds it
from its config; :class:`chimera.api.Pipeline` makes one with :meth:`RunContext.here` when it
is given none) and passed down: ``Pipeline -> PipelineRuntime -> Executor`` and to the code
around a run (checkpoints, fault reports, the bench). Nothing below it looks up an ambient
transport or reads the environment.

- ``transport``: how the ranks talk, with its traits as attributes
  (:class:`~chimera.runtime.transport.Transport`: ``matches_by_tag``, ``device_collectives``,
  ``timed_waits``) instead of tests of the backend's name.
- ``device``: where this rank computes.
- ``options``: the runtime's switches (:class:`RuntimeOptions`), one field per config field of
  ``chimera train`` (``--comm-timeout``, ``--device-plan``, ``--emulate-nccl``, ``--malloc``,
  ``--fault``); the ``CHIMERA_*`` environment variables are only a way to set them
  (:meth:`RuntimeOptions.from_env`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Mapping

import torch

from chimera.errors import UserError
from chimera.runtime.transport import Transport, current

__all__ = ["ENV", "EMULATION_MODES", "RunContext", "RuntimeOptions"]

EMULATION_MODES = ("pair", "rank", "strict")  # NCCL's stream models, strictest last
MALLOC_MODES = ("keep", "default")
# the bounds of --comm-timeout: below a second the ranks cannot rendezvous; above a week it is
# no timeout (and overflows C's)
MIN_COMM_TIMEOUT_S, MAX_COMM_TIMEOUT_S = 1.0, 7 * 24 * 3600.0
# field -> the environment variable that may set it (and what spawned ranks inherit)
ENV = {"device_plan": "CHIMERA_DEVICE_PLAN", "emulate_nccl": "CHIMERA_EMULATE_NCCL",
       "malloc": "CHIMERA_MALLOC", "fault": "CHIMERA_FAULT"}


def _device_plan(value) -> int:
    """``CHIMERA_DEVICE_PLAN``'s text or an int: 0 (off), 1 (on), or a bucket size in bytes."""
    text = str(value).strip()
    if text in ("", "0"):
        return 0
    if not text.isdigit():
        raise UserError(f"device plan {value!r}: 1 (the device plan) or a bucket size in bytes "
                        f"(0 or unset: off; {ENV['device_plan']})")
    return int(text)


@dataclass(frozen=True)
class RuntimeOptions:
    """The runtime's switches, alike on every rank (checked at start-up).

    ``comm_timeout``: seconds before a p2p or collective wait becomes an error (timed waits
    only; NCCL's own timeout and watchdog otherwise). ``device_plan``: 0 decides buckets and
    reduce-scatters by the device (the device path on CUDA or NCCL); 1 forces the device path's
    decisions on a CPU run, so CPU tests issue the collectives a GPU run issues; above 1 also
    sets the bucket size in bytes (a tiny model cut into several buckets).
    ``emulate_nccl``: "" or one of ``pair``, ``rank``, ``strict``: NCCL's p2p and collective
    semantics emulated on the transport (:mod:`chimera.runtime.nccl_emulation`). ``malloc``:
    ``keep`` tunes glibc to keep freed memory in the process (:mod:`chimera.runtime.allocator`),
    ``default`` leaves it alone. ``fault``: faults to inject on purpose (drills;
    :mod:`chimera.train.faults`), e.g. ``kill:1:3``.
    """

    comm_timeout: float = 300.0
    device_plan: int = 0
    emulate_nccl: str = ""
    malloc: str = "keep"
    fault: str = ""

    def __post_init__(self) -> None:
        t = self.comm_timeout
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not \
                MIN_COMM_TIMEOUT_S <= t <= MAX_COMM_TIMEOUT_S:  # NaN fails every comparison
            raise UserError(f"comm_timeout must be between {MIN_COMM_TIMEOUT_S:g} and "
                            f"{MAX_COMM_TIMEOUT_S:g} seconds, got {t!r}")
        object.__setattr__(self, "device_plan", _device_plan(self.device_plan))
        object.__setattr__(self, "emulate_nccl", self.emulate_nccl or "")
        object.__setattr__(self, "fault", self.fault or "")
        if self.emulate_nccl and self.emulate_nccl not in EMULATION_MODES:
            raise UserError(f"NCCL emulation {self.emulate_nccl!r}: choose one of "
                            f"{', '.join(EMULATION_MODES)} (or none; {ENV['emulate_nccl']})")
        malloc = (self.malloc or "keep").lower()
        if malloc not in MALLOC_MODES:
            raise UserError(f"malloc {self.malloc!r}: keep or default ({ENV['malloc']})")
        object.__setattr__(self, "malloc", malloc)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **given) -> "RuntimeOptions":
        """Options from ``CHIMERA_*`` variables, for the fields not ``given`` (None counts as
        not given)."""
        environ = os.environ if environ is None else environ
        values = {name: environ[var] for name, var in ENV.items() if environ.get(var, "") != ""}
        values.update({k: v for k, v in given.items() if v is not None})
        return cls(**values)

    @property
    def strict(self) -> bool:
        """One stream per rank for p2p and collectives together (the strictest emulation)."""
        return self.emulate_nccl == "strict"


@dataclass(frozen=True)
class RunContext:
    """One process's run: its transport, its device and the runtime's options."""

    transport: Transport
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    options: RuntimeOptions = field(default_factory=RuntimeOptions)

    def __post_init__(self) -> None:
        device = torch.device(self.device)
        if device.type == "cuda" and device.index is None:  # "cuda": this process's current GPU
            device = torch.device("cuda", torch.cuda.current_device())
        object.__setattr__(self, "device", device)

    @classmethod
    def here(cls, transport: Transport | None = None, device=None,
             options: RuntimeOptions | None = None, **given) -> "RunContext":
        """The context of a run starting in this process: ``transport`` (default the one in
        effect: ``torch.distributed``, or a virtual rank's on its thread), ``device`` (default
        ``cuda:LOCAL_RANK`` where the transport's collectives need the device, else the CPU)
        and ``options`` (default from the environment, with the option fields ``given``)."""
        transport = transport if transport is not None else current()
        if device is None:
            device = default_device(transport)
        return cls(transport, device, options or RuntimeOptions.from_env(**given))

    def replace(self, **changes) -> "RunContext":
        return dataclasses.replace(self, **changes)

    @property
    def rank(self) -> int:
        return self.transport.get_rank()

    @property
    def world(self) -> int:
        return self.transport.get_world_size()

    @property
    def collective_device(self) -> torch.device:
        """Where tensors handed to a collective of the default group must live: the current
        CUDA device where the transport's collectives need it (NCCL), else the CPU."""
        return collective_device(self.transport)


def default_device(transport: Transport) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is there and the transport's collectives run on the device
    (gloo moves CPU tensors)."""
    if torch.cuda.is_available() and transport.device_collectives:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def collective_device(transport: Transport) -> torch.device:
    """Where a collective's tensors live for ``transport``: the current CUDA device where its
    collectives need the device (NCCL, which rejects CPU tensors), the CPU otherwise."""
    if transport.is_initialized() and transport.device_collectives:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class ExecOptions:
    """How a pipeline's step runs, alike on every rank.

    ``schedule_options``: the scheme's options when the schedule is given by name (e.g.
    ``{"pipes": 4}``); ``sync``: when a stage's replicas start reducing (``eager``: after
    its last backward on the rank; ``end``); ``recompute``: activation checkpointing per
    stage; ``autocast``: a dtype to run forwards under autocast; ``wire_dtype``: floating
    boundary leaves travel in it (None: as computed); ``shard_optimizer``: ZeRO-1 over each
    stage's replicas; ``sync_buffers``: average floating buffers (BatchNorm statistics) of a
    stage's replicas after every step; ``check_batch``: compare a fingerprint of the
    mini-batch across ranks (every rank must be given the same one).
    """

    schedule_options: Mapping | None = None
    sync: str = "eager"
    recompute: bool = False
    autocast: torch.dtype | None = None
    wire_dtype: torch.dtype | None = None
    shard_optimizer: bool = False
    sync_buffers: bool = True
    check_batch: bool = True

    def __post_init__(self) -> None:
        if self.sync not in ("eager", "end"):
            raise UserError(f"sync must be 'eager' or 'end', got {self.sync!r}")
