"""Tensors handed to collectives live where the backend needs them (NCCL: the current GPU)."""

from collections import defaultdict
from types import SimpleNamespace

import torch

from chimera.runtime import context
from chimera.train.checkpoint.state import init_adam_state


def test_collective_device_is_the_current_gpu_under_nccl(monkeypatch):
    def transport(device_collectives):
        return SimpleNamespace(is_initialized=lambda: True, device_collectives=device_collectives)

    monkeypatch.setattr(context.torch.cuda, "current_device", lambda: 3)
    assert context.collective_device(transport(True)) == torch.device("cuda", 3)
    assert context.collective_device(transport(False)) == torch.device("cpu")


class _Optimizer:
    def __init__(self, fused):
        self.defaults = {"fused": fused}
        self.state = defaultdict(dict)


def test_restored_adam_step_lives_where_fused_adam_keeps_it():
    p = torch.nn.Parameter(torch.zeros(3, device="meta"))  # stands for a CUDA parameter
    fused = _Optimizer(True)
    init_adam_state(fused, p)
    assert fused.state[p]["step"].device == p.device
    plain = _Optimizer(False)
    init_adam_state(plain, p)
    assert plain.state[p]["step"].device == torch.device("cpu")  # where plain AdamW keeps it


def test_every_tensor_the_runtime_hands_to_dist_is_on_its_device():
    """The runtime on the meta device (a stand-in for a GPU this machine lacks) over virtual
    ranks: every p2p and collective tensor of start-up and of one iteration (every schedule
    kind: chimera with its replica allreduce, 1f1b, a split backward) is on that device, and
    the iteration reads nothing back to the host (meta tensors cannot be read)."""
    from chimera.runtime.transport import Wrapping, current
    from chimera.runtime.virtual import run_virtual
    from chimera.train.config import TrainConfig
    from chimera.train.loop import Trainer, run_context

    seen = []

    class Recording(Wrapping):
        def isend(self, tensor, dst, tag=0, group=None):
            seen.append(("isend", tensor.device))
            return super().isend(tensor, dst, tag, group)

        def irecv(self, tensor, src, tag=0, group=None):
            seen.append(("irecv", tensor.device))
            return super().irecv(tensor, src, tag, group)

        def all_reduce(self, tensor, op=None, group=None, async_op=False):
            seen.append(("all_reduce", tensor.device))
            return super().all_reduce(tensor, group=group, async_op=async_op)

    meta = torch.device("meta")
    for schedule in ("chimera", "1f1b", "zb-h1"):
        cfg = TrainConfig(schedule=schedule, stages=2, micro_batches=4, micro_batch_size=2, steps=1)

        def body(rank):
            # the virtual rank's transport (in effect on its thread), recorded
            trainer = Trainer(cfg, run_context(cfg, meta, Recording(current())))
            trainer.runtime.zero_grad()
            loss = trainer.runtime.run(trainer._micro_data(*trainer.batch(0)))
            assert loss.device == meta
            assert trainer.runtime.owned_sq_norm().device == meta

        run_virtual(cfg.world, body)
    kinds = {k for k, _ in seen}
    assert kinds == {"isend", "irecv", "all_reduce"}, kinds
    assert all(device == meta for _, device in seen), [s for s in seen if s[1] != meta][:3]
