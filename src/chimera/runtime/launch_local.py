"""``spawn``: run a function in local processes joined in one process group, and when they
fail, say why with the root cause first.

When one rank raises, its peers usually fail next with a communication error ("Connection
closed by peer", a timeout): whichever process the launcher notices first is often such a
victim. Each rank writes its error (time, type, message, traceback) to a shared directory;
after the first failure the others get a grace period to finish failing, and the report
orders the errors: those that are not communication errors first, earliest first.
"""

from __future__ import annotations

import json
import os
import pickle
import tempfile
import time
import traceback
from typing import Callable

import torch
import torch.distributed as dist

from chimera.errors import UserError
from chimera.runtime import workers
from chimera.runtime.workers import end_group

GRACE_S = 20.0  # after a failure, how long the other ranks get to report their own


class SpawnError(RuntimeError):
    """One or more ranks failed; ``errors`` lists them root cause first."""

    def __init__(self, message: str, errors: list[dict]):
        super().__init__(message)
        self.errors = errors


def _entry(rank: int, world: int, blob: bytes, store: int, backend: str, errdir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:  # here, not in multiprocessing's bootstrap, so that a failure is reported as the rest
        fn = pickle.loads(blob)
    except BaseException as exc:
        exc.add_note("the function spawn was given could not be rebuilt in the new process: "
                     "define it at the top level of an importable module (not in __main__ of "
                     "an interactive session, not as a lambda or a nested function)")
        _report(errdir, rank, exc)
        raise SystemExit(1) from None
    kw = {}
    if backend == "nccl":  # bound to its GPU: communicators created now, barriers know it
        torch.cuda.set_device(rank)
        kw["device_id"] = torch.device("cuda", rank)
    timeout = dist.default_pg_timeout
    try:  # reported like the function's own failure: one line from the launcher, no traceback
        dist.init_process_group(backend, store=workers.store_client(store, world, timeout),
                                rank=rank, world_size=world, timeout=timeout, **kw)
    except BaseException as exc:
        exc.add_note(f"rank {rank} could not join the process group ({backend}, {world} ranks)")
        _report(errdir, rank, exc)
        raise SystemExit(1) from None
    try:
        fn(rank, world)
    except BaseException as exc:
        _report(errdir, rank, exc)  # the launcher reports it, root cause first
        raise SystemExit(1) from None  # no teardown: a peer may be gone
    end_group(torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu"))


def _report(errdir: str, rank: int, exc: BaseException) -> None:
    text = f"{type(exc).__name__}: {exc}"
    text += "".join(f" ({note})" for note in getattr(exc, "__notes__", ()))
    info = {"rank": rank, "time": time.time(), "error": text, "comm": workers.is_peer_failure(exc),
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))}
    with open(os.path.join(errdir, f"{rank}.json"), "w") as f:
        json.dump(info, f)


def spawn(fn: Callable[[int, int], None], world: int, backend: str = "gloo") -> None:
    """Run ``fn(rank, world)`` in ``world`` local processes joined in one process group.

    Raises :class:`SpawnError` if any rank fails, with every rank's error, root cause first;
    ValueError (``UserError``) for a ``world`` below 1 or a function that cannot be pickled.
    """
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise UserError(f"spawn: world must be a positive integer (processes to start), "
                        f"got {world!r}")
    try:  # by reference: fails here for a lambda or a nested function, not in every child
        blob = pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise UserError(f"spawn: the function cannot be sent to new processes ({exc}); define "
                        "it at the top level of an importable module") from None
    with tempfile.TemporaryDirectory(prefix="chimera-spawn-") as errdir:
        with workers.hosted_store(world) as store:  # outlives every rank: workers.hosted_store
            codes = workers.run(_entry, (world, blob, store, backend, errdir), world, grace=GRACE_S)
        if any(c != 0 for c in codes):
            raise _error(errdir, codes)


def _unreported(codes: workers.Exits, rank: int) -> dict:
    """A rank that exited without recording an error: killed (a cause, unless the launcher
    stopped it), or failed while starting."""
    code = codes[rank]
    if code is not None and code < 0:
        stopped = rank in codes.stopped
        return {"rank": rank, "time": codes.ended[rank] or float("inf"), "comm": stopped,
                "traceback": "", "error": f"{workers.ending(codes, rank)} (no Python error)"}
    return {"rank": rank, "time": float("inf"), "comm": True, "traceback": "",
            "error": f"exited with code {code} before its function ran (the process failed while "
                     "starting: its traceback, printed above, says why, e.g. __main__ could not "
                     "be imported in the new process)"}


def _error(errdir: str, codes: workers.Exits) -> SpawnError:
    errors = []
    for rank, code in enumerate(codes):
        path = os.path.join(errdir, f"{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                errors.append(json.load(f))
        elif code != 0:
            errors.append(_unreported(codes, rank))
    errors.sort(key=lambda e: (e["comm"], e["time"]))
    root = errors[0]
    lines = [f"rank {root['rank']} failed (root cause): {root['error']}", root["traceback"].rstrip()]
    same = [e["rank"] for e in errors[1:] if e["error"] == root["error"]]
    if same:
        lines.append(f"(the same error on rank {', '.join(map(str, same))})")
    for e in errors[1:]:
        if e["error"] != root["error"]:
            lines.append(f"then rank {e['rank']}: {e['error']}")
    return SpawnError("\n".join(lines), errors)
