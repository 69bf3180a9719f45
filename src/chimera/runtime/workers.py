"""Local worker processes that never outlive their launcher, and one way for them to end.

The contract of every local launch (``chimera train``, the API's ``spawn``, the bench
harness, the profiler, the equivalence check):

- A signal to the launcher (SIGINT, SIGTERM, SIGHUP) stops every rank within seconds:
  SIGTERM, then SIGKILL after ``STOP_S``; the launcher then raises :class:`Interrupted`.
- The launcher's death, even by SIGKILL, ends its ranks: each asks the kernel for SIGKILL
  when its parent dies (``PR_SET_PDEATHSIG``; torch's default there is SIGINT, which a
  script's ``&`` ignores), and a watchdog thread polls the parent id where prctl is missing.
- Ranks ignore SIGINT: Ctrl-C reaches the whole foreground group, and the launcher decides.
- When ranks fail, the one that failed first is named (:func:`summary`): killed by a signal or
  failed on its own, not a peer that then failed on communication with it (exit code
  ``PEER_EXIT``) nor one the launcher stopped.
- A rank that succeeded tears its group down with :func:`end_group` and leaves through
  ``os._exit``: interpreter shutdown racing gloo's threads aborted ("terminate called
  without an active exception").
- The launcher hosts the ranks' rendezvous store (:func:`hosted_store`); every rank is a
  client of it (:func:`store_client`), so the store outlives any one rank.

Killing a rank at any moment leaves the newest checkpoint intact: a checkpoint is
published by one rename, complete or absent (``chimera.train.checkpoint``).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_S = 5.0  # after SIGTERM, how long a rank gets before SIGKILL
# the exit code of a rank that failed on communication (a peer gone, a timeout): it followed
# another's failure, so the summary names that one (``cause``); 75 is sysexits' EX_TEMPFAIL
PEER_EXIT = 75
PEER_ERRORS = ("CommTimeout", "DistBackendError", "DistNetworkError", "DistStoreError",
               "RendezvousFailed")
RENDEZVOUS_S = 300.0  # how long ranks get to connect at start-up (chimera train: --rendezvous-timeout)
COMM_WORDS = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout",
              "nccl", "gloo", "peer", "socket")
WATCH_S = 0.25  # how often the watchdog looks at the parent id
LOOPBACK = "127.0.0.1"
_PR_SET_PDEATHSIG = 1


class RendezvousFailed(RuntimeError):
    """The ranks did not all connect at start-up within the rendezvous timeout."""


class Interrupted(KeyboardInterrupt):
    """The launcher got ``signum``; every rank it started has been stopped."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


# -- in the launcher ----------------------------------------------------------------------
def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now (for a new process group)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def hosted_store(world: int):
    """The rendezvous store of ``world`` local ranks, hosted here in the launcher on the
    loopback address; yields its port for the ranks' :func:`store_client`.

    Hosted by rank 0 (env://'s way), the store died with rank 0, and each rank that then
    posted to it (its position, ``chimera.train.faults``) printed torch's ~25-line C++
    "sendBytes failed ... Broken pipe" block. The launcher outlives every rank. Port 0: the
    kernel picks a free port and the server holds it from now on (no window in which another
    process takes a port chosen for it)."""
    store = dist.TCPStore(LOOPBACK, 0, world, is_master=True, wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store  # the server stops with its last reference


def run(fn, args: tuple, nprocs: int, grace: float) -> Exits:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes; return their exit codes
    (:class:`Exits`: :func:`cause` and :func:`summary` name the rank that failed first).

    Once one fails the others get ``grace`` seconds to fail too (and say why), then are
    stopped. A signal to this process stops them all and raises :class:`Interrupted`.
    """
    ctx = mp.get_context("spawn")
    procs = []
    previous = _catch_signals()
    try:
        for rank in range(nprocs):
            procs.append(ctx.Process(target=_bound, args=(rank, fn, os.getpid(), args),
                                     name=f"chimera-rank-{rank}"))
            procs[-1].start()
        return _wait(procs, grace)
    finally:
        _set_handlers(dict.fromkeys(previous, signal.SIG_IGN))  # a second Ctrl-C must not cut stop short
        try:
            stop(procs)
        finally:
            _set_handlers(previous)


class Exits(list):
    """The exit codes of :func:`run`'s processes, in rank order (a list), and how each ended:
    ``ended`` (``time.time()`` when the launcher saw it exit; None: it never exited on its
    own) and ``stopped`` (the ranks the launcher stopped once the grace after a failure was
    over: victims, never a cause)."""

    def __init__(self, codes, ended, stopped=()):
        super().__init__(codes)
        self.ended = list(ended)
        self.stopped = frozenset(stopped)


def cause(codes: list[int]) -> int | None:
    """The rank whose failure the others followed, or None when none failed: a rank killed
    by a signal or failed on its own (not ``PEER_EXIT``, not stopped by the launcher) before
    one that failed because a peer was gone, then the earliest to end (``Exits``), then the
    lowest rank."""
    failed = [r for r, c in enumerate(codes) if c != 0]
    if not failed:
        return None
    ended = getattr(codes, "ended", [None] * len(codes))
    stopped = getattr(codes, "stopped", frozenset())
    return min((r in stopped or codes[r] == PEER_EXIT, r in stopped,
                math.inf if ended[r] is None else ended[r], r) for r in failed)[-1]


def ending(codes: list[int], rank: int) -> str:
    """How ``rank`` ended, in words: 'killed by SIGTERM', 'failed (exit code 1)', ..."""
    code = codes[rank]
    if rank in getattr(codes, "stopped", ()):
        return "stopped by the launcher"
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == PEER_EXIT:
        return "failed on communication (a peer gone, or a wait past --comm-timeout)"
    return f"failed (exit code {code})"


def summary(codes: list[int]) -> str:
    """One line naming the rank that failed first ('rank 1 failed first (killed by SIGTERM)'),
    then the ranks that followed it; '' when none failed."""
    root = cause(codes)
    if root is None:
        return ""
    then = [f"rank {r} ({ending(codes, r)})" for r, c in enumerate(codes) if c != 0 and r != root]
    return f"rank {root} failed first ({ending(codes, root)})" + (f"; then {', '.join(then)}" if then else "")


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a communication error: what a rank raises when a peer failed.

    gloo raises a plain RuntimeError naming the closed connection (at the call as well as at
    the wait); torch's own, the DistError family (DistBackendError, DistNetworkError,
    DistStoreError: a store whose host is gone); Python's sockets a ConnectionError
    (ConnectionResetError, BrokenPipeError, ...) or a TimeoutError. Text decides for any
    other type (a message naming gloo, a closed connection, a timeout)."""
    if isinstance(exc, (dist.DistError, ConnectionError, TimeoutError)):
        return True
    text = f"{type(exc).__name__}: {exc}".lower()
    return type(exc).__name__ in PEER_ERRORS or any(w in text for w in COMM_WORDS)


def stop(procs) -> None:
    """SIGTERM every live process, SIGKILL those still alive ``STOP_S`` later; reap all."""
    live = [p for p in procs if p.pid is not None and p.exitcode is None]
    for p in live:
        p.terminate()
    deadline = time.monotonic() + STOP_S
    for p in live:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in live:
        if p.exitcode is None:
            p.kill()
            p.join()


def _wait(procs, grace: float) -> Exits:
    failed_at, ended = None, [None] * len(procs)
    while True:
        codes = [p.exitcode for p in procs]
        ended = [e if e is not None or c is None else time.time() for e, c in zip(ended, codes)]
        if all(c is not None for c in codes):
            return Exits(codes, ended)
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace:
            stopped = [r for r, c in enumerate(codes) if c is None]
            stop(procs)
            return Exits([p.exitcode for p in procs], ended, stopped)
        time.sleep(0.05)


def _raise_interrupted(signum, _frame) -> None:
    raise Interrupted(signum)


def _catch_signals() -> dict:
    """Install handlers raising Interrupted; return the previous ones ({} off the main thread,
    where Python allows no handlers: the caller's thread owns the signals then)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    # a signal ignored when we started (a script's `cmd &` ignores SIGINT) stays ignored
    _set_handlers({s: _raise_interrupted for s, h in previous.items() if h is not signal.SIG_IGN})
    return previous


def _set_handlers(handlers: dict) -> None:
    for s, h in handlers.items():
        signal.signal(s, h if h is not None else signal.SIG_DFL)


# -- in a worker --------------------------------------------------------------------------
def _bound(rank: int, fn, parent: int, args: tuple) -> None:
    bind_to_parent(parent)
    code = 0
    try:
        fn(rank, *args)
    except SystemExit as exc:  # fn has said why
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:
        traceback.print_exc()
        code = PEER_EXIT if is_peer_failure(exc) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def bind_to_parent(parent: int, ignore_sigint: bool = True) -> None:
    """End this process when ``parent`` dies (kernel signal plus a watchdog thread)."""
    if ignore_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)
    threading.Thread(target=_watch, args=(parent,), daemon=True, name="chimera-parent-watch").start()


def _set_pdeathsig(sig: int) -> None:
    if not sys.platform.startswith("linux"):
        return  # the watchdog alone
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # the watchdog alone


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_S)
    os.kill(os.getpid(), signal.SIGKILL)


def end_group(device) -> None:
    """The one teardown of a worker that succeeded: finish outstanding device work, barrier
    (no rank closes its connections while a peer still uses them: gloo aborted at exit under
    load without it), drop unreachable group objects, destroy. Only on success: after a
    failure a peer may be gone, so skip the barrier."""
    if not dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()
    gc.collect()  # a subgroup kept alive by a reference cycle would outlive its backend
    dist.destroy_process_group()


def store_client(port: int, world: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """A rank's connection to its launcher's :func:`hosted_store` at ``port`` (a client, never
    the server); gets wait up to ``timeout``."""
    return dist.TCPStore(LOOPBACK, port, world, is_master=False, timeout=timeout)


def join_group(init, rank: int, world: int, rendezvous_s: float, timeout_s: float | None,
               nccl_device=None, what: str = "rendezvous timeout") -> None:
    """``init(timeout)`` (an ``init_process_group``) and the group's first barrier (every rank
    is there) within ``rendezvous_s``, then the group's timeout is ``timeout_s`` for the work
    (None: torch's default): a loaded machine slow to start its ranks does not spend the
    steps' limit. :class:`RendezvousFailed`, one line naming ``what`` set the limit, when they
    do not all connect."""
    try:
        init(datetime.timedelta(seconds=rendezvous_s))
        dist.barrier(**({"device_ids": [nccl_device.index]} if nccl_device is not None else {}))
    except (RuntimeError, TimeoutError) as exc:  # torch's DistError family, a store timeout
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RendezvousFailed(f"rank {rank}: the {world} ranks did not all connect at start-up "
                               f"({what} {rendezvous_s:g}s): {first}") from None
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else dist.default_pg_timeout
    dist.distributed_c10d._set_pg_timeout(timeout)


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int, threads: int = 1, timeout_s: float | None = None,
               rendezvous_s: float = RENDEZVOUS_S):
    """A worker's default gloo group over the store its launcher hosts at ``port``
    (:func:`hosted_store`; connected within ``rendezvous_s``, then ``timeout_s`` for the work:
    :func:`join_group`), torn down by :func:`end_group` when the body succeeds (after a
    failure a peer may be gone: no barrier, no destroy)."""
    torch.set_num_threads(threads)
    join_group(lambda start: dist.init_process_group("gloo", store=store_client(port, world, start),
                                                     rank=rank, world_size=world, timeout=start),
               rank, world, rendezvous_s, timeout_s)
    yield
    end_group(torch.device("cpu"))
