"""Bring your own model: pipeline-train a plain list of layers with Chimera on 2 processes.

Run: .venv/bin/python examples/byo_model.py
It trains a small MLP regression with Chimera (D=2, N=4) and prints the loss every 20 steps.
"""

import torch
from torch import nn

import chimera.api as chimera


def make_layers():
    """Any modules mapping one tensor to one tensor; called with the same seed on every rank."""
    return [nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)]


def batch(step: int, rows: int = 32):
    """The same mini-batch on every rank: a deterministic function of the step."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(rows, 16, generator=g)
    return x, x[:, :1].sin() + 0.5 * x[:, 1:2]


def main(rank: int, world: int) -> None:
    pipe = chimera.Pipeline(make_layers, nn.functional.mse_loss, schedule="chimera", stages=2,
                            micro_batches=4, micro_batch_size=8, example_input=torch.zeros(1, 16))
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    for step in range(100):
        loss = pipe.step(*batch(step))
        opt.step()
        if rank == 0 and step % 20 == 0:
            print(f"step {step:3d}  loss {loss:.4f}")


if __name__ == "__main__":
    chimera.spawn(main, world=2)
