"""Models and the training recipe the API tests run both pipelined and in one process.

``TinyGPT``: a GPT-2-shaped model in miniature: token embedding tied with the output head,
(hidden, int64 mask) boundaries, blocks that mix positions under the mask, and a head that
returns (logits, per-row auxiliary loss), so an extra output reaches the loss. The batch is
padded (mask 0, target -100) with lengths that differ per row; the loss is token_mean.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

V, C, T = 11, 8, 6  # vocabulary, width, longest sequence


class Embed(nn.Module):
    def __init__(self, wte: nn.Embedding):
        super().__init__()
        self.wte = wte
        self.wpe = nn.Parameter(torch.randn(T, C) * 0.1)

    def forward(self, ids, mask):
        return self.wte(ids) + self.wpe[:ids.shape[1]], mask  # (B, T, C), (B, T) int64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(C), nn.Linear(C, C)

    def forward(self, h, mask):
        m = mask.unsqueeze(-1).to(h.dtype)
        z = torch.tanh(self.fc(self.ln(h))) * m
        return h + z.cumsum(1) / m.cumsum(1).clamp(min=1), mask  # a masked causal mean


class Head(nn.Module):
    def __init__(self, wte: nn.Embedding):
        super().__init__()
        self.ln, self.wte = nn.LayerNorm(C), wte

    def forward(self, h, mask):
        logits = self.ln(h) @ self.wte.weight.T  # (B, T, V): the tied weight
        return logits, 1e-2 * (h * mask.unsqueeze(-1)).pow(2).sum((1, 2))  # aux: (B,)


def make_gpt(blocks: int = 3, tied: bool = True) -> list[nn.Module]:
    """``tied=False``: the head gets its own copy of the embedding (same initial values)."""
    wte = nn.Embedding(V, C)
    head = Head(wte if tied else copy.deepcopy(wte))
    return [layer.double() for layer in [Embed(wte), *[Block() for _ in range(blocks)], head]]


def gpt_loss(logits, aux, targets):
    """A sum over tokens (token_mean divides by the mini-batch's count of real targets)."""
    ce = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), reduction="sum", ignore_index=-100)
    return ce + aux.sum()


def gpt_batch(seed: int, rows: int, length: int = T):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (rows, length), generator=g)
    lengths = torch.randint(1, length + 1, (rows,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    targets = torch.randint(0, V, (rows, length), generator=g).masked_fill(mask == 0, -100)
    return (ids, mask), targets


def forward(layers, x):
    for layer in layers:
        x = layer(*x) if isinstance(x, tuple) else layer(x)
    return x


# the recipe: 3 optimizer steps; zero_grad in both modes; step 1 accumulates two mini-batches
# of different sequence lengths (a new shape: re-probe); clipping on every step
def plan(rows: int) -> list[list]:
    return [[gpt_batch(0, rows)], [gpt_batch(1, rows), gpt_batch(2, rows, length=4)],
            [gpt_batch(3, rows)]]


CLIP = 0.5


def reference(rows: int, blocks: int = 3, tied: bool = True) -> dict:
    torch.manual_seed(0)
    layers = make_gpt(blocks, tied)
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    out = {"grads": [], "norms": [], "losses": []}
    for k, batches in enumerate(plan(rows)):
        opt.zero_grad(set_to_none=k != 1)
        for (x, y) in batches:
            loss = gpt_loss(*forward(layers, x), y) / int((y != -100).sum())
            loss.backward()
            out["losses"].append(float(loss.detach()))
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        # every name, a tied one twice: the pipeline's copies carry either name
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)})
        opt.step()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    x, y = gpt_batch(9, rows)
    with torch.no_grad():
        logits, aux = forward(layers, x)
        out["eval_loss"] = float(gpt_loss(logits, aux, y) / int((y != -100).sum()))
        out["eval_logits"] = logits
    out["state_dict"] = model.state_dict()
    return out


def pipelined(pipe, rows: int) -> dict:
    """The same recipe through a Pipeline (every rank runs it)."""
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.05, weight_decay=0.1)
    out = {"grads": [], "norms": [], "losses": []}
    for k, batches in enumerate(plan(rows)):
        opt.zero_grad(set_to_none=k != 1)
        for i, (x, y) in enumerate(batches):
            out["losses"].append(pipe.step(x, y, accumulate=i > 0))
        out["norms"].append(float(pipe.clip_grad_norm_(CLIP)))
        if pipe.runtime.shards:  # each replica holds its slice of the sum: gather the rest
            pipe.runtime.gather_gradients()
        out["grads"].append([(n, p.grad.clone()) for n, p in pipe.named_parameters()])
        opt.step()
    out["params"] = [(n, p.detach().clone()) for n, p in pipe.named_parameters()]
    x, y = gpt_batch(9, rows)
    out["eval_loss"], (out["eval_logits"], _) = pipe.eval().eval_step(x, y, return_outputs=True)
    pipe.train()
    out["state_dict"] = pipe.state_dict()
    return out
