"""Start the processes of a run: spawn local ranks, or join the group torchrun set up.

Rank 0 collects every rank's measured action times of the traced step and the final
figures, and hands them back to the launching process through a JSON file (no pickles).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chimera.train.config import TrainConfig
from chimera.train.loop import StepLog, Trainer, log_line, peak_rss_mb


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(cfg: TrainConfig) -> tuple[torch.device, str]:
    want = cfg.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    return device, backend


def run_rank(rank: int, world: int, cfg: TrainConfig, result_path: str | None,
             hooks=None) -> dict | None:
    """Body of one rank: init the group, train, gather results on rank 0."""
    torch.set_num_threads(cfg.threads)
    device, backend = pick_device(cfg)
    if cfg.reference:
        trainer = Trainer(cfg, 0, device)
        return _train(trainer, cfg, result_path, hooks)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg.comm_timeout))
    try:
        trainer = Trainer(cfg, rank, device)
        return _train(trainer, cfg, result_path, hooks)
    finally:
        dist.destroy_process_group()


def _train(trainer: Trainer, cfg: TrainConfig, result_path: str | None, hooks) -> dict | None:
    rank = 0 if cfg.reference else dist.get_rank()
    trace_step = cfg.trace_step if cfg.trace_step is not None else cfg.steps - 1
    bar = _progress(cfg) if rank == 0 else None
    logs: list[StepLog] = []
    record: list = []
    log_file = open(cfg.log_json, "w") if (cfg.log_json and rank == 0) else None
    try:
        for step in range(cfg.steps):
            log = trainer.step(step, record if step == trace_step else None)
            logs.append(log)
            if hooks is not None:
                hooks(trainer, step, log)
            if log_file:
                log_file.write(log_line(log) + "\n")
                log_file.flush()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{log.loss:.4f}", tok_s=f"{log.tokens / log.seconds:,.0f}")
    finally:
        if bar is not None:
            bar.close()
        if log_file:
            log_file.close()
    return _collect(trainer, cfg, logs, record, result_path)


def _progress(cfg: TrainConfig):
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.steps, desc=f"{cfg.schedule} D={cfg.stages} W={cfg.data_parallel}",
                unit="step", file=sys.stderr, dynamic_ncols=True)


def _collect(trainer: Trainer, cfg: TrainConfig, logs, record, result_path) -> dict | None:
    mine = {"records": [(str(r.action), r.start, r.end, r.cpu) for r in record],
            "peak_rss_mb": peak_rss_mb()}
    if record and not cfg.reference:  # wall-clock start of the records: aligns the ranks
        mine["t0"] = trainer.runtime.executor.record_epoch
    if torch.cuda.is_available() and trainer.device.type == "cuda":
        mine["peak_cuda_mb"] = torch.cuda.max_memory_allocated(trainer.device) / 2**20
    if cfg.reference:
        gathered = [mine]
    else:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if dist.get_rank() != 0:
            return None
    result = {
        "config": cfg.to_dict(),
        "steps": [vars(l) for l in logs],
        "ranks": gathered,
    }
    if result_path:
        with open(result_path, "w") as f:
            json.dump(result, f)
    return result


def _spawn_entry(rank: int, world: int, cfg: TrainConfig, port: int, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        run_rank(rank, world, cfg, result_path)
    except Exception:
        traceback.print_exc()
        raise


def launch(cfg: TrainConfig) -> dict:
    """Run ``cfg`` to the end and return rank 0's result dict.

    Under torchrun (RANK and WORLD_SIZE set) this process is one rank; otherwise it spawns
    ``cfg.world`` local processes that rendezvous on the loopback address.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not cfg.reference:
        world = int(os.environ["WORLD_SIZE"])
        if world != cfg.world:
            raise ValueError(f"torchrun started {world} processes but the layout needs "
                             f"W·D = {cfg.data_parallel}·{cfg.stages} = {cfg.world}")
        return run_rank(int(os.environ["RANK"]), world, cfg, None) or {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        if cfg.reference:
            run_rank(0, 1, cfg, path)
        else:
            mp.start_processes(_spawn_entry, args=(cfg.world, cfg, free_port(), path),
                               nprocs=cfg.world, start_method="spawn")
        with open(path) as f:
            return json.load(f)
