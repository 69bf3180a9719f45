"""What a checkpoint holds and how it is written and read back (torch.distributed.checkpoint).

What one holds, keyed so that it depends on neither D, W nor the schedule:

- ``model.<name>``: every parameter once, under its model-wide name
  (``blocks.3.attn.qkv.weight``; HF's for an HF model, a tie under its first name), written by the rank holding the stage's pipe-0 replica
  in data replica 0 (``Trainer.checkpoint_parameters``) and read back by every replica.
- ``optim.<name>.exp_avg | exp_avg_sq | step``: AdamW's state of that parameter.
- ``rng.cpu.rank<r>``: each rank's torch RNG state (restored when the world size matches).
- ``meta.json`` (``chimera.train.checkpoint.record``).

Where it is written, published and pruned is the manager's (``CheckpointManager``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from chimera.runtime.context import collective_device
from chimera.runtime.transport import Transport
from chimera.tp import full_tensor, local_slice
from chimera.train.checkpoint import light
from chimera.train.checkpoint.disk import (CheckpointError, NonFiniteCheckpoint, dcp_call,
                                           rank_world, read_index, read_light_index, safe_reader)
from chimera.train.checkpoint.record import read_meta
from chimera.train.faults import collective

_OPTIM_KEYS = ("exp_avg", "exp_avg_sq", "step")


# -- what goes in -------------------------------------------------------------------------
def _tensors(optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor],
             whole: dict | None = None) -> dict[str, torch.Tensor]:
    """Flat DCP state of ``params``: each parameter and its AdamW state, by name. ``whole``:
    the whole AdamW state of parameters a sharded optimizer holds in slices (by parameter),
    so a checkpoint does not depend on sharding. A frozen parameter has no AdamW state (the
    optimizer does not hold it): only itself."""
    state = {}
    trained = {id(q) for group in optimizer.param_groups for q in group["params"]}
    for name, p in params.items():
        state[f"model.{name}"] = p.detach()
        if id(p) not in trained and p not in (whole or {}):
            continue
        adam = (whole or {}).get(p)
        if adam is None:
            init_adam_state(optimizer, p)  # a skipped first step leaves none yet
            adam = optimizer.state[p]
        for key in _OPTIM_KEYS:
            state[f"optim.{name}.{key}"] = adam[key]
    return state


def _first_nonfinite(state: dict[str, torch.Tensor]) -> str | None:
    for key, value in state.items():
        # a NaN or inf makes the sum non-finite; the exact test only runs where it is
        if value.is_floating_point() and not torch.isfinite(value.sum()) \
                and not bool(torch.isfinite(value).all()):
            return key
    return None


def gather(trainer, step: int) -> dict[str, torch.Tensor]:
    """This rank's share of the checkpoint after ``step`` optimizer steps (collective over
    the trainer's ranks). Raises NonFiniteCheckpoint on every rank when some parameter or
    optimizer state is NaN or infinite on any."""
    transport = trainer.context.transport
    rank, _ = rank_world(transport)
    whole = trainer.whole_optimizer_state()  # sharded: gathered over each group (collective)
    params = trainer.checkpoint_parameters()
    state = _tensors(trainer.optimizer, params, whole)
    tp = trainer.pipe.tp
    for key, shard, _ in list(_sharded(trainer, params, state)):
        # whole (a collective over TP, every t alike), then at once to the host and kept by
        # t = 0 only: a device never holds more than one whole tensor of its stage
        full = full_tensor(state.pop(key), shard, tp).cpu()
        if tp.rank == 0:
            state[key] = full
    state[f"rng.cpu.rank{rank}"] = torch.get_rng_state()
    _refuse_nonfinite(transport, state, step)
    return state


def write(transport: Transport, state: dict[str, torch.Tensor], folder: Path, what: str) -> None:
    """Every rank of ``transport`` writes its ``state`` into ``folder`` (collective; fsynced).
    A world of one writes alone, whatever process group this process is in."""
    import torch.distributed.checkpoint as dcp  # loaded when a checkpoint is used: start-up time

    rank, world = rank_world(transport)
    dcp_call(rank, f"writing {what}", dcp.save, state,
             storage_writer=dcp.FileSystemWriter(folder, sync_files=True), no_dist=world == 1)


def _refuse_nonfinite(transport: Transport, state: dict, step: int) -> None:
    bad = _first_nonfinite(state)
    flag = torch.tensor([0.0 if bad is None else 1.0], device=collective_device(transport))
    if rank_world(transport)[1] > 1:
        collective(transport, "checkpoint: agreeing that the state is finite",
                   transport.all_reduce, flag)
    if flag.item():
        where = f" ({bad} on this rank)" if bad else " (on another rank)"
        raise NonFiniteCheckpoint(f"refusing to write the checkpoint of step {step}: the state "
                                  f"holds NaN or infinite values{where}")


# -- what comes out -----------------------------------------------------------------------
def load(trainer, path: Path) -> int:
    """Load the checkpoint ``path`` into ``trainer``; return the step to continue at.

    Collective: every rank loads the same folder. Parameters and AdamW state are read by
    name, so the layout may differ from the writer's.
    """
    import torch.distributed.checkpoint as dcp  # loaded when a checkpoint is used: start-up time

    rank, world = rank_world(trainer.context.transport)
    meta = read_meta(path)
    index = read_index(path)
    replicas = _replicas_by_name(trainer)
    whole = trainer.whole_optimizer_state(empty=True)  # sharded: read whole, then sliced
    firsts = {name: ps[0] for name, ps in replicas.items()}
    state = _tensors(trainer.optimizer, firsts, whole)
    narrow = list(_sharded(trainer, firsts, state))  # read whole, then each rank its slice
    for key, shard, _ in narrow:
        state[key] = torch.empty(_whole_shape(state[key], shard), dtype=state[key].dtype)  # host
    rng_key = f"rng.cpu.rank{rank}"
    if meta["layout"]["world"] == world and rng_key in index:
        state[rng_key] = torch.empty_like(torch.get_rng_state())
    _check_against_index(state, index, path)
    dcp_call(rank, f"reading {path}", dcp.load, state, storage_reader=safe_reader(path),
             no_dist=world == 1)
    if rng_key in state:
        torch.set_rng_state(state[rng_key])
    with torch.no_grad():
        for key, shard, target in narrow:
            target.copy_(local_slice(state.pop(key), shard, trainer.pipe.tp))  # to its device
    trainer.load_whole_optimizer_state(whole)
    _copy_to_other_replicas(trainer, replicas)
    trainer.equalize_ties()  # a tie is one key, read into each copy: equal, and kept so
    trainer.load_run_state(meta.get("run") or {})
    return int(meta["step"])


def _sharded(trainer, params: dict[str, torch.Tensor], state: dict):
    """(key, Shard, the local tensor) of every state entry of a tensor-parallel shard: the
    parameter and its AdamW moments, in the parameters' order (the same on every TP rank)."""
    shards = trainer.tp_shards()
    for name, p in params.items():
        shard = shards.get(id(p))
        if shard is None:
            continue
        for key in (f"model.{name}", f"optim.{name}.exp_avg", f"optim.{name}.exp_avg_sq"):
            if key in state:  # (a frozen parameter has no AdamW state)
                yield key, shard, state[key]


def _whole_shape(local: torch.Tensor, shard) -> tuple:
    """The unpadded whole shape of a shard's tensor (a moment has its parameter's)."""
    return tuple(shard.full_shape)


def _replicas_by_name(trainer) -> dict[str, list[torch.Tensor]]:
    out: dict[str, list[torch.Tensor]] = {}
    for name, _pipe, p in trainer.replica_parameters():
        out.setdefault(name, []).append(p)
    return out


def init_adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> None:
    """The state AdamW creates on its first step, to be overwritten by the checkpoint's."""
    state = optimizer.state[p]
    if not state:  # fused or capturable AdamW keeps its step count on the parameter's device
        on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _check_against_index(state: dict, index: dict, path: Path) -> None:
    """Every wanted key present with the same shape: the model matches the checkpoint."""
    for key, value in state.items():
        if key not in index:
            raise CheckpointError(f"checkpoint {path} has no {key!r}: it was written for "
                                  "another model or by another optimizer")
        if tuple(value.shape) != index[key][0]:
            raise CheckpointError(f"checkpoint {path}: {key!r} has shape {list(index[key][0])}, "
                                  f"this model's is {list(value.shape)}")


def _copy_to_other_replicas(trainer, replicas: dict[str, list[torch.Tensor]]) -> None:
    """A rank holding two replicas of a stage loaded the first; the others copy it."""
    with torch.no_grad():
        for ps in replicas.values():
            src = trainer.optimizer.state.get(ps[0])
            for p in ps[1:]:
                p.copy_(ps[0])
                if not src:  # frozen: no AdamW state
                    continue
                init_adam_state(trainer.optimizer, p)
                for key in _OPTIM_KEYS:
                    trainer.optimizer.state[p][key].copy_(src[key])


def load_model_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The parameters of a checkpoint by model-wide name, in one process (no process group).

    ``chimera.models.build_model(cfg, seed).load_state_dict(load_model_state(path))`` gives
    the single-device model the run had reached. A bf16-master run saves its trained
    parameters' float32 masters and its frozen ones (``--freeze``) in bf16: those come back
    in float32 too (exactly), so the model has one dtype.
    """
    path = Path(path)
    # read without DCP where the tensors are stored whole (start-up time: chimera generate)
    state = light.model_state(path, read_light_index(path))
    if state is None:
        import torch.distributed.checkpoint as dcp  # loaded when it is needed: start-up time

        index = read_index(path)
        state = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in index.items()
                 if key.startswith("model.")}
        dcp_call(0, f"reading {path}", dcp.load, state, storage_reader=safe_reader(path),
                 no_dist=True)
    if {t.dtype for t in state.values()} == {torch.bfloat16, torch.float32}:
        state = {k: v.float() for k, v in state.items()}
    return {key[len("model."):]: value for key, value in state.items()}
