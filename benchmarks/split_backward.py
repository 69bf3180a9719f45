"""Cost of the split backward (I + W) against one full backward B, on this machine.

Usage: python benchmarks/split_backward.py [--model gpt2-bench] [--reps 15]
One thread; a stage of 4 transformer blocks with micro-batch 2; B and I+W runs interleaved,
medians reported; writes benchmarks/results/split_backward.json.
"""

import argparse
import json
import os
import statistics
import time

import torch
from torch import nn

from chimera.models import build_layers, get_config
from chimera.runtime.split_backward import backward_input, backward_weight


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-bench")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--blocks", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = get_config(args.model)
    stage = nn.Sequential(*build_layers(cfg, 0, range(1, 1 + args.blocks)))
    params = list(stage.parameters())
    x0 = torch.randn(2, cfg.seq_len, cfg.d_model)
    g = torch.randn(2, cfg.seq_len, cfg.d_model)

    def full():
        x = x0.clone().requires_grad_()
        y = stage(x)
        t = time.perf_counter()
        torch.autograd.backward(y, g)
        return time.perf_counter() - t

    def split():
        x = x0.clone().requires_grad_()
        y = stage(x)
        t = time.perf_counter()
        _, pending = backward_input(y, x, g, params)
        t1 = time.perf_counter()
        backward_weight(pending)
        return t1 - t, time.perf_counter() - t1

    full(), split()  # warm-up
    b, i, w = [], [], []
    for _ in range(args.reps):
        b.append(full())
        ii, ww = split()
        i.append(ii)
        w.append(ww)
    res = {"model": args.model, "blocks": args.blocks, "reps": args.reps,
           "B_ms": statistics.median(b) * 1e3, "I_ms": statistics.median(i) * 1e3,
           "W_ms": statistics.median(w) * 1e3,
           "ratio_I_plus_W_over_B": statistics.median([x + y for x, y in zip(i, w)]) / statistics.median(b)}
    print(f"{args.model}, {args.blocks} blocks, micro-batch 2, 1 thread, median of {args.reps}: "
          f"B {res['B_ms']:.1f} ms, I {res['I_ms']:.1f} ms, W {res['W_ms']:.1f} ms, "
          f"(I+W)/B = {res['ratio_I_plus_W_over_B']:.3f}")
    out = os.path.join(os.path.dirname(__file__), "results", "split_backward.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
