"""Start the processes of a run: spawn local ranks, or join the group torchrun set up.

Rank 0 collects every rank's measured action times of the traced step and the final
figures, and hands them back to the launching process through a JSON file (no pickles).
Ids the data makes in memory (text through ``--tokenizer``) are made once, here, and the
spawned ranks map them from a token file in the launcher's temporary folder.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from chimera.data import Corpus
from chimera.data.formats import ids_in_memory, open_data, to_token_file
from chimera.errors import UserError
from chimera.runtime import workers
from chimera.runtime.allocator import keep_freed_memory
from chimera.runtime.p2p import CommTimeout
from chimera.runtime.context import RunContext
from chimera.runtime.transport import TorchDist
from chimera.runtime.workers import RendezvousFailed, end_group
from chimera.train import build, checkpoint, compiler, faults
from chimera.train.checkpoint import CheckpointManager
from chimera.train.checkpoint.keeper import Keeper
from chimera.train.config import TrainConfig
from chimera.train.loop import (NonFiniteLoss, StepLog, Trainer, log_line, peak_rss_mb,
                                run_context, runtime_options)
from chimera.train.watch import Watch, model_flops_per_token, peak_flops_per_rank


class TrainingFailed(RuntimeError):
    """A rank of a spawned run failed; its own message went to stderr."""


# What ends a run with a message instead of a traceback (exit code 1); a rank that failed on
# communication (a peer gone) exits with workers.PEER_EXIT, so the launcher names the cause.
COMM_FAILURES = (CommTimeout, RendezvousFailed)
FAILURES = COMM_FAILURES + (NonFiniteLoss, checkpoint.NonFiniteCheckpoint,
                            checkpoint.CheckpointError, checkpoint.CheckpointIOError,
                            compiler.CompileFailed)


# after one rank fails, how long the others get to say where they were before being stopped
FAILURE_GRACE_S = 10.0


def pick_device(cfg: TrainConfig) -> tuple[torch.device, str]:
    want = cfg.run.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    backend = cfg.run.backend
    backend = backend if backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    return device, backend


def run_rank(rank: int, world: int, cfg: TrainConfig, result_path: str | None,
             hooks=None, corpus: Corpus | None = None, store: int | None = None) -> dict | None:
    """Body of one rank: init the group, train, gather results on rank 0. ``corpus``: the
    data the launcher opened (None: the rank reads --data); ``store``: the port of the store
    the launcher hosts (``workers.hosted_store``; None: env://, rank 0 or torchrun hosts it)."""
    torch.set_num_threads(cfg.run.threads)
    options = runtime_options(cfg)
    keep_freed_memory(options.malloc)
    device, backend = pick_device(cfg)
    if cfg.reference:
        trainer = Trainer(cfg, run_context(cfg, device), corpus)
        return _train(trainer, cfg, result_path, hooks)
    try:
        _init_group(backend, rank, world, cfg.run, device, store)
        trainer = Trainer(cfg, RunContext(TorchDist(), device, options), corpus)
        result = _train(trainer, cfg, result_path, hooks)
        end_group(device)  # its barrier too may meet a peer gone
    except Exception as exc:  # say why now: a launcher may SIGTERM us once any rank has exited
        failed = failure(exc, rank)
        if failed is None:
            raise  # a bug: its traceback
        if not getattr(failed, "reported", False):  # (set where another rank says why)
            print(f"chimera train: {failed}", file=sys.stderr, flush=True)
        failed.reported = True
        if failed is exc:
            raise  # no destroy_process_group: its peers may be gone
        raise failed from exc
    return result


def failure(exc: BaseException, rank: int) -> BaseException | None:
    """What ends rank ``rank`` with one line instead of a traceback: ``exc`` itself when it is
    one of FAILURES; a communication error of any other type (``workers.is_peer_failure``:
    gloo's RuntimeError at a call the runtime does not wrap, torch's DistError family, a
    ConnectionError, a TimeoutError) as a CommTimeout naming the rank; None for anything
    else."""
    if isinstance(exc, FAILURES):
        return exc
    if not (isinstance(exc, Exception) and workers.is_peer_failure(exc)):
        return None
    first = (str(exc).strip().splitlines() or [""])[0]
    detail = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return CommTimeout(f"rank {rank}: communication failed, a peer gone or a wait past "
                       f"--comm-timeout ({detail})", rank=rank)


def _init_group(backend: str, rank: int, world: int, run, device: torch.device,
                store: int | None = None) -> None:
    """The default group, connected within ``run.rendezvous_timeout`` (the group's first
    barrier included: every rank is there), then given ``run.comm_timeout`` for the steps."""
    workers.join_group(lambda start: _connect(backend, rank, world, start, device, store), rank, world,
                       run.rendezvous_timeout, run.comm_timeout,
                       device if backend == "nccl" else None, "--rendezvous-timeout")


def _connect(backend: str, rank: int, world: int, timeout: datetime.timedelta,
             device: torch.device, store: int | None) -> None:
    # device_id binds the group to this rank's GPU: NCCL creates its communicator now (not
    # inside the first iteration) and barriers know their device
    kw = {"device_id": device} if backend == "nccl" else {}
    if store is not None:  # spawned here: the launcher hosts the store
        dist.init_process_group(backend, store=workers.store_client(store, world, timeout),
                                rank=rank, world_size=world, timeout=timeout, **kw)
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kw)
        return
    # torchrun keeps one store across restarts, so a restarted rank may read the dead
    # attempt's gloo addresses and fail to connect: give each attempt its own key prefix.
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    dist.init_process_group(backend, store=dist.PrefixStore(f"chimera/attempt_{attempt}", store),
                            rank=rank, world_size=world, timeout=timeout, **kw)


def _train(trainer: Trainer, cfg: TrainConfig, result_path: str | None, hooks) -> dict | None:
    # the directory's lease, before anything is read from it or written to it
    manager = None
    if cfg.ckpt.checkpoint_dir:
        manager = CheckpointManager(cfg.ckpt.checkpoint_dir, cfg.ckpt.keep_checkpoints,
                                    trainer.context.transport)
        manager.claim(cfg.ckpt.resume)
    try:
        return _train_owning(trainer, cfg, result_path, hooks, manager)
    except Exception as exc:  # torch.compile's failure: one line, not its traceback
        failed = compiler.explain(exc, f"rank {trainer.rank}: ")
        if failed is None:
            raise
        raise failed from exc
    finally:
        if manager is not None:
            manager.release()


def _train_owning(trainer: Trainer, cfg: TrainConfig, result_path: str | None, hooks,
                  manager: CheckpointManager | None) -> dict | None:
    rank, fault = trainer.rank, trainer.context.options.fault
    start = manager.restore(trainer) if cfg.ckpt.resume else 0
    trace_step = cfg.run.trace_step if cfg.run.trace_step is not None else cfg.optim.steps - 1
    bar = _progress(cfg, start) if rank == 0 else None
    board = cfg.run.tensorboard
    watch = Watch(trainer, board, rank) if board else None  # times every step
    logs: list[StepLog] = []
    record: list = []
    log_file = _open_log(cfg.run.log_json, start) if (cfg.run.log_json and rank == 0) else None
    keeper = Keeper(cfg, trainer, manager, rank, start)
    try:
        for step in range(start, cfg.optim.steps):
            faults.before_step(rank, step, fault)
            try:
                log = trainer.step(step, record if step == trace_step else None,
                                   on_grads=faults.grad_hook(rank, step, fault))
            except NonFiniteLoss as exc:
                keeper.stopped(step, exc)  # the checkpoint of these weights is in doubt
                raise
            if _eval_due(cfg, step + 1):
                began = time.perf_counter()
                log.val_loss = trainer.evaluate()
                log.eval_seconds = time.perf_counter() - began
            if watch is not None:
                watch.after_step(log, trainer.last_records)
            logs.append(log)
            if hooks is not None:
                hooks(trainer, step, log)
            if log_file:
                log_file.write(log_line(log) + "\n")
                log_file.flush()
            if log.skipped and rank == 0:
                print(_skip_message(trainer, log), file=sys.stderr)
            if bar is not None:
                _show(bar, logs)
            keeper.after_step(step, log)
            if _checkpoint_due(cfg, step + 1):
                keeper.publish(step + 1, log)
        keeper.finish(cfg.optim.steps)
    finally:
        if bar is not None:
            bar.close()
        if log_file:
            log_file.close()
        if watch is not None:
            watch.close()
    return _collect(trainer, cfg, logs, record, result_path)


def _skip_message(trainer: Trainer, log: StepLog) -> str:
    if trainer.scaler is not None and math.isfinite(log.loss):  # fp16: expected now and then
        return (f"step {log.step}: float16 gradients overflowed: skipped (no optimizer step), "
                f"loss scale now {trainer.scaler.scale:g}")
    return (f"step {log.step}: loss {log.loss} / grad norm {log.grad_norm} not finite: skipped "
            "(no optimizer step)")


def _announce(cfg: TrainConfig) -> None:
    """A resume that changes accepted settings says so, once (not applied silently)."""
    if build.resume_changes(cfg) and os.environ.get("RANK", "0") == "0":
        print(f"chimera train: resuming from {build.resume_from(cfg)} with these changes:\n"
              + "\n".join(build.resume_changes(cfg)), file=sys.stderr, flush=True)


def _show(bar, logs: list[StepLog]) -> None:
    """The progress bar after ``logs[-1]``: loss, tokens/s, and the latest held-out loss."""
    log = logs[-1]
    held = next((l.val_loss for l in reversed(logs) if l.val_loss is not None), None)
    bar.update(1)
    bar.set_postfix(loss=f"{log.loss:.4f}", tok_s=f"{log.tokens / log.seconds:,.0f}",
                    **({"val": f"{held:.4f}"} if held is not None else {}))


def _eval_due(cfg: TrainConfig, done: int) -> bool:
    """After ``done`` steps: every ``eval_every`` steps, and at the end of the run."""
    return cfg.run.eval_every > 0 and (done % cfg.run.eval_every == 0 or done == cfg.optim.steps)


def _checkpoint_due(cfg: TrainConfig, done: int) -> bool:
    """After ``done`` steps: every ``checkpoint_every`` steps, and at the end of the run."""
    if cfg.ckpt.checkpoint_dir is None:
        return False
    every = cfg.ckpt.checkpoint_every
    return done == cfg.optim.steps or (every > 0 and done % every == 0)


def _open_log(path: str, start: int):
    """The --log-json file; resuming at ``start`` keeps the lines of the steps before it."""
    kept = []
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # checked writable up front
    if start > 0 and os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] < start]
    f = open(path, "w")
    f.writelines(kept)
    return f


def _progress(cfg: TrainConfig, start: int = 0):
    if not cfg.run.progress:
        return None
    from tqdm import tqdm  # only when a bar is drawn

    # one process draws the bar: a thread lock, not tqdm's default multiprocessing one, whose
    # semaphore a spawned rank leaves behind ("resource_tracker: ... leaked semaphore")
    tqdm.set_lock(threading.RLock())
    p = cfg.pipeline
    return tqdm(total=cfg.optim.steps, initial=start, unit="step", file=sys.stderr,
                dynamic_ncols=True, desc=f"{p.schedule} D={p.stages} W={p.data_parallel}")


def _collect(trainer: Trainer, cfg: TrainConfig, logs, record, result_path) -> dict | None:
    mine = {"records": [(str(r.action), r.start, r.end, r.cpu) for r in record],
            "peak_rss_mb": peak_rss_mb(), "optimizer_state_bytes": trainer.optimizer_state_bytes()}
    if record and not cfg.reference:  # wall-clock start of the records: aligns the ranks
        mine["t0"] = trainer.runtime.executor.record_epoch
    if torch.cuda.is_available() and trainer.device.type == "cuda":
        mine["peak_cuda_mb"] = torch.cuda.max_memory_allocated(trainer.device) / 2**20
    if cfg.reference:
        gathered = [mine]
    else:
        transport = trainer.context.transport
        gathered = [None] * transport.get_world_size()
        faults.collective(transport, "gathering the results on rank 0",
                          transport.all_gather_object, gathered, mine)
        if transport.get_rank() != 0:
            return None
    result = {
        "config": cfg.to_dict(),
        "steps": [vars(l) for l in logs],
        "ranks": gathered,
        # model FLOPs utilization: the summary's, against the peak it names
        "model_flops_per_token": model_flops_per_token(trainer.source),
        "peak_flops": peak_flops_per_rank(cfg.run.peak_flops, trainer.device),
    }
    if result_path:
        with open(result_path, "w") as f:
            json.dump(result, f)
    return result


def _spawn_entry(rank: int, world: int, cfg: TrainConfig, store: int, result_path: str,
                 corpus: Corpus | None) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        run_rank(rank, world, cfg, result_path, corpus=corpus, store=store)
    except FAILURES as exc:
        if not getattr(exc, "reported", False):
            print(f"chimera train: {exc}", file=sys.stderr, flush=True)
        sys.exit(workers.PEER_EXIT if isinstance(exc, COMM_FAILURES) else 1)  # a peer's failure, or its own


def _shared_ids(cfg: TrainConfig, corpus: Corpus | None, path: str) -> Corpus | None:
    """The corpus the spawned ranks read when its ids are made in memory (text through a
    tokenizer): made once, here (or taken from ``corpus``), written to ``path`` for every
    rank to map. None for bytes and token files, which each rank reads for itself."""
    if not ids_in_memory(build.data_info(cfg)):
        return None
    if corpus is None:
        corpus = open_data(build.data_spec(cfg), seq_len=build.model_source(cfg).seq_len,
                           progress=cfg.run.progress)
    try:
        return to_token_file(corpus, path)
    except OSError as exc:
        raise UserError(f"cannot write the tokenized ids to {os.path.dirname(path)}: "
                        f"{exc.strerror} (set TMPDIR to a folder with room)") from None


def _say_what_resume_skips(cfg: TrainConfig) -> None:
    """--resume passes over checkpoints in doubt (``checkpoint.resumable``): say which, once."""
    if not (cfg.ckpt.resume and cfg.ckpt.checkpoint_dir) or os.environ.get("RANK", "0") != "0":
        return
    path, skipped = CheckpointManager(cfg.ckpt.checkpoint_dir).resumable()
    for folder, why in skipped:
        print(f"chimera train: --resume: passing over {folder.name}, in doubt ({why}); "
              f"resuming from {path.name}", file=sys.stderr)


def launch(cfg: TrainConfig, corpus: Corpus | None = None) -> dict:
    """Run ``cfg`` to the end and return rank 0's result dict.

    Under torchrun (RANK and WORLD_SIZE set) this process is one rank; otherwise it spawns
    ``cfg.world`` local processes that rendezvous on the loopback address. ``cfg.preflight()``
    runs first, so bad input is refused before any process starts. ``corpus``: cfg's data,
    opened already (``chimera train`` checks it first), so it is not read again.
    """
    cfg.preflight()  # data, model, schedule, checkpoints: refused before any process starts
    _announce(cfg)
    # the runtime's switches (a malformed --fault or CHIMERA_* variable) refused here, before
    # any process starts
    faults.active(runtime_options(cfg).fault)
    _say_what_resume_skips(cfg)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not cfg.reference:
        world = int(os.environ["WORLD_SIZE"])
        if world != cfg.world:
            p = cfg.pipeline
            raise UserError(f"torchrun started {world} processes but the layout needs "
                             f"W·D·T = {p.data_parallel}·{p.stages}·{p.tensor_parallel} = "
                             f"{cfg.world}")
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent is our parent: die with it
            workers.bind_to_parent(os.getppid(), ignore_sigint=False)
        return run_rank(int(os.environ["RANK"]), world, cfg, None, corpus=corpus) or {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        if cfg.reference:
            run_rank(0, 1, cfg, path, corpus=corpus)
        else:
            shared = _shared_ids(cfg, corpus, os.path.join(tmp, "ids.bin"))
            corpus = None  # the ranks read their own (or ``shared``): not a copy held all run
            with workers.hosted_store(cfg.world) as store:
                codes = workers.run(_spawn_entry, (cfg.world, cfg, store, path, shared),
                                    cfg.world, grace=FAILURE_GRACE_S)
            if workers.cause(codes) is not None:  # the rank that failed first, not one that noticed
                raise TrainingFailed(f"{workers.summary(codes)}; the ranks' messages are above")
        with open(path) as f:
            return json.load(f)
