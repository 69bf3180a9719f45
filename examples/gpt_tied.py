"""A GPT-2-style model through the API: tied embeddings, a padding mask, token-mean loss,
gradient accumulation, clipping, evaluation and a state_dict export.

Run: .venv/bin/python examples/gpt_tied.py
Two processes train with Chimera (D=2, N=4); rank 0 exports the model to gpt_tied.pt and
checks that the exported single-device model gives the pipeline's evaluation loss.
"""

import os
import tempfile

import torch
from torch import nn
from torch.nn import functional as F

import chimera.api as chimera

VOCAB, WIDTH, HEADS, LENGTH, BLOCKS = 64, 32, 4, 16, 4


class Embed(nn.Module):
    """(ids, mask) -> (hidden, mask): the mask (int64, 1 = real token) travels with the hidden
    states across stage boundaries, bit-exact."""

    def __init__(self, wte: nn.Embedding):
        super().__init__()
        self.wte, self.wpe = wte, nn.Embedding(LENGTH, WIDTH)

    def forward(self, ids, mask):
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.wte(ids) + self.wpe(pos), mask  # (B, T, C), (B, T)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, h, mask):
        b, t, c = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
        keys = mask.bool()[:, None, None, :] | torch.eye(t, dtype=torch.bool, device=h.device)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal & keys)  # (B, H, T, C/H)
        h = h + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return h + self.mlp(self.ln2(h)), mask


class Head(nn.Module):
    def __init__(self, wte: nn.Embedding):
        super().__init__()
        self.ln, self.wte = nn.LayerNorm(WIDTH), wte  # the tied weight (GPT-2's lm_head)

    def forward(self, h, mask):
        return self.ln(h) @ self.wte.weight.T  # (B, T, VOCAB)


def make_layers():
    """One shared nn.Embedding in the first and last layer: the API finds the tie."""
    wte = nn.Embedding(VOCAB, WIDTH)
    nn.init.normal_(wte.weight, std=0.02)  # GPT-2's initialization
    return [Embed(wte), *[Block() for _ in range(BLOCKS)], Head(wte)]


def loss_fn(logits, targets):
    """A sum over real tokens; loss_reduction="token_mean" divides by the mini-batch's count."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=-100)


def batch(step: int, rows: int = 16):
    """Padded sequences of a toy language (next token = token + 1 mod VOCAB)."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (rows, 1), generator=g)
    ids = (start + torch.arange(LENGTH)) % VOCAB
    lengths = torch.randint(LENGTH // 2, LENGTH + 1, (rows,), generator=g)
    mask = (torch.arange(LENGTH) < lengths[:, None]).long()
    targets = ((ids + 1) % VOCAB).masked_fill(mask == 0, -100)
    return (ids, mask), targets


def main(rank: int, world: int, out: str) -> None:
    pipe = chimera.Pipeline(make_layers, loss_fn, schedule="chimera", stages=2, micro_batches=4,
                            micro_batch_size=4, loss=chimera.LossOptions(reduction="token_mean"))
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    for step in range(30):
        opt.zero_grad()  # either mode is fine: the pipeline re-attaches its gradient buffers
        loss = pipe.step(*batch(2 * step), loss_scale=0.5)  # two mini-batches per update:
        loss += pipe.step(*batch(2 * step + 1), accumulate=True, loss_scale=0.5)  # their mean
        norm = pipe.clip_grad_norm_(1.0)  # the whole model's norm, tie counted once
        opt.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss:.4f}  grad norm {float(norm):.3f}")
    eval_loss = pipe.eval().eval_step(*batch(1000))
    state = pipe.state_dict()  # gathered on rank 0 ({} elsewhere); ties stored once
    if rank == 0:
        torch.save(state, out)
        with open(out + ".eval", "w") as f:  # what the export must reproduce on one device
            f.write(repr(eval_loss))
        print(f"eval loss {eval_loss:.4f}; exported {len(state)} tensors to {out}")


def check_export(path: str) -> None:
    """The export is a plain nn.Sequential state dict: load it and evaluate on one device."""
    model = nn.Sequential(*make_layers())
    model.load_state_dict(torch.load(path))
    assert model[0].wte.weight is model[-1].wte.weight
    model.eval()
    (ids, mask), targets = batch(1000)
    with torch.no_grad():
        x = (ids, mask)
        for layer in model:
            x = layer(*x) if isinstance(x, tuple) else layer(x)
        loss = float(loss_fn(x, targets) / int((targets != -100).sum()))
    with open(path + ".eval") as f:
        pipelined = float(f.read())
    assert abs(loss - pipelined) < 1e-5 * max(1.0, abs(pipelined)), (loss, pipelined)
    print(f"single-device eval loss of the export {loss:.4f} matches the pipeline's")


if __name__ == "__main__":
    import functools

    path = os.path.join(tempfile.mkdtemp(), "gpt_tied.pt")
    chimera.spawn(functools.partial(main, out=path), world=2)
    check_export(path)
