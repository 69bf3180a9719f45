"""Tensors handed to collectives live where the backend needs them (NCCL: the current GPU)."""

from collections import defaultdict

import torch

from chimera.runtime import grid
from chimera.train import checkpoint


def test_collective_device_is_the_current_gpu_under_nccl(monkeypatch):
    monkeypatch.setattr(grid.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(grid.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(grid.torch.cuda, "current_device", lambda: 3)
    assert grid.collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(grid.dist, "get_backend", lambda group=None: "gloo")
    assert grid.collective_device() == torch.device("cpu")


class _Optimizer:
    def __init__(self, fused):
        self.defaults = {"fused": fused}
        self.state = defaultdict(dict)


def test_restored_adam_step_lives_where_fused_adam_keeps_it():
    p = torch.nn.Parameter(torch.zeros(3, device="meta"))  # stands for a CUDA parameter
    fused = _Optimizer(True)
    checkpoint._init_adam_state(fused, p)
    assert fused.state[p]["step"].device == p.device
    plain = _Optimizer(False)
    checkpoint._init_adam_state(plain, p)
    assert plain.state[p]["step"].device == torch.device("cpu")  # where plain AdamW keeps it
