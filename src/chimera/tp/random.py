"""Dropout under tensor parallelism: Megatron-LM's RNG discipline, with explicit generators.

Each rank of a TP group holds a :class:`TPRandom`: two ``torch.Generator``s of its own (never
torch's global one, which the threads of virtual ranks share and draw from in no fixed order):

- ``replicated``: seeded alike on the T ranks of a pipeline rank. A dropout on a replicated
  tensor (after a row-parallel projection's allreduce, after the vocab-parallel embedding)
  draws from it, so every TP rank draws the same mask, as the one tensor it stands for needs;
- ``sharded``: seeded per t. A dropout on a sharded tensor (the attention probabilities of
  this rank's heads, a column-parallel hidden) draws from it, so the T ranks draw independent
  masks for their disjoint slices, as one process draws independent elements.

Both are seeded from the run's seed and the pipeline rank (w*D + d), so replicas and
data-parallel copies draw independent masks for their different micro-batches. The T ranks
run the same program in lockstep, so the replicated streams stay equal. Recomputation replays
the masks: :meth:`TPRandom.recompute_context` is the ``context_fn`` of torch's non-reentrant
checkpoint, which takes the generators' states as the forward starts and sets them again
for the recomputed forward.

Not one process's masks: one process draws the mask of all H heads' attention from one
stream in one (B, H, S, S) draw, T ranks draw their (B, H/T, S, S) from T streams. Drawing the
whole mask on every rank and keeping its slice would be exact, at T times the random numbers
and the memory of the whole mask on each rank; Megatron-LM does not, and neither does this.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

STREAMS = ("replicated", "sharded")
_SHARDED = 0x5EED  # keeps a sharded stream's seed apart from every replicated one


class TPRandom:
    """The generators of TP rank ``t`` of pipeline rank ``pipe_rank`` (w*D + d), from ``seed``."""

    def __init__(self, seed: int, pipe_rank: int, t: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        base = (seed * 1_000_003 + pipe_rank) * 4099
        self.replicated = torch.Generator(self.device).manual_seed(base % 2**63)
        self.sharded = torch.Generator(self.device).manual_seed((base + _SHARDED + 1 + t) % 2**63)

    def generator(self, stream: str) -> torch.Generator:
        if stream not in STREAMS:
            raise ValueError(f"dropout stream must be one of {STREAMS}, got {stream!r}")
        return self.replicated if stream == "replicated" else self.sharded

    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.replicated.get_state(), self.sharded.get_state()

    def set_states(self, states: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.replicated.set_state(states[0])
        self.sharded.set_state(states[1])

    def recompute_context(self):
        """(forward, recompute) context managers for ``torch.utils.checkpoint``'s
        ``context_fn``: the recomputed forward draws the masks the forward drew, and the
        generators then go on from where they were."""
        taken: list = []

        @contextlib.contextmanager
        def forward():
            taken.append(self.states())
            yield

        @contextlib.contextmanager
        def recompute():
            now = self.states()
            self.set_states(taken[0])
            try:
                yield
            finally:
                self.set_states(now)

        return forward(), recompute()

    def dropout(self, x: torch.Tensor, p: float, stream: str) -> torch.Tensor:
        """``F.dropout(x, p, training=True)`` with its mask drawn from ``stream``."""
        if p <= 0:
            return x
        if p >= 1:
            return x * 0
        keep = torch.empty_like(x).bernoulli_(1 - p, generator=self.generator(stream))
        return x * keep * (1 / (1 - p))


class TPDropout(nn.Module):
    """An ``nn.Dropout`` of a tensor-parallel layer: its mask from the TP rank's ``stream``."""

    def __init__(self, p: float, random: TPRandom, stream: str = "replicated"):
        super().__init__()
        random.generator(stream)  # a bad stream name fails here, not at the first forward
        self.p, self.random, self.stream = p, random, stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.random.dropout(x, self.p, self.stream) if self.training else x

    def __deepcopy__(self, memo) -> "TPDropout":
        out = TPDropout(self.p, self.random, self.stream)  # a copy draws from the same streams
        out.train(self.training)
        return out

    def extra_repr(self) -> str:
        return f"p={self.p}, stream={self.stream}"
