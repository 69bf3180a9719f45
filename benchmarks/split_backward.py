"""Cost of the split backward (I + W) against one full backward B, on this machine.

Usage: python benchmarks/split_backward.py [--model gpt2-bench] [--reps 15] [--runs 3]

Two measurements, both written to out/split_backward.json (--out DIR):

- isolated: one thread, a stage of 4 transformer blocks at micro-batch 2; B and I+W run
  interleaved right after their forward, medians reported. This favours B: it starts while
  the forward's last activations are still in cache, where W runs after I has evicted them.
- in the pipeline: `chimera train` runs 1F1B (B) and ZB-H1 (I then W) on the same stages
  (gpt2-bench, D=2, N=8 micro-batches of 2), alternating ``--runs`` times; the thread CPU
  time of every B, I and W action of the traced step gives medians per stage. This is the
  cost a schedule pays.
"""

import argparse
import json
import os
import sys
import statistics
import time

import torch
from torch import nn

from chimera.ir import Op
from chimera.models import build_layers, get_config
from chimera.runtime.allocator import keep_freed_memory
from chimera.runtime.split_backward import backward_input, backward_weight

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outdir import out_dir  # noqa: E402  (--out DIR, default out/)

OUT = os.path.join(out_dir(), "split_backward.json")


def isolated(model: str, blocks: int, reps: int) -> dict:
    cfg = get_config(model)
    stage = nn.Sequential(*build_layers(cfg, 0, range(1, 1 + blocks)))
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

    def input_only():  # I without the bookkeeping W needs: what that bookkeeping costs
        x = x0.clone().requires_grad_()
        y = stage(x)
        t = time.perf_counter()
        torch.autograd.grad(y, (x,), g, retain_graph=True)
        return time.perf_counter() - t

    full(), split(), input_only()  # warm-up
    b, i, w, plain = [], [], [], []
    for _ in range(reps):
        b.append(full())
        ii, ww = split()
        i.append(ii)
        w.append(ww)
        plain.append(input_only())
    return {"blocks": blocks, "reps": reps, "B_ms": statistics.median(b) * 1e3,
            "I_ms": statistics.median(i) * 1e3, "W_ms": statistics.median(w) * 1e3,
            "I_without_bookkeeping_ms": statistics.median(plain) * 1e3,
            "ratio_I_plus_W_over_B": statistics.median([x + y for x, y in zip(i, w)]) / statistics.median(b)}


def _action_cpu_times(schedule: str, model: str) -> dict:
    """Thread CPU seconds of every B, I, W action of one traced step, by (op, stage)."""
    from chimera.train import TrainConfig
    from chimera.train.launch import launch
    from chimera.train.report import measured_timeline

    cfg = TrainConfig(model=model, schedule=schedule, stages=2, micro_batches=8,
                      micro_batch_size=2, steps=3, progress=False)
    timeline = measured_timeline(cfg.build_schedule(), launch(cfg))
    out: dict = {}
    for e in timeline.events:
        if e.action.op in (Op.B, Op.I, Op.W) and e.cpu is not None:
            out.setdefault((e.action.op.value, e.action.stage), []).append(e.cpu)
    return out


def in_pipeline(model: str, runs: int) -> dict:
    samples: dict = {}
    for _ in range(runs):
        for schedule in ("1f1b", "zb-h1"):
            for key, values in _action_cpu_times(schedule, model).items():
                samples.setdefault(key, []).extend(values)
    per_stage = []
    for stage in range(2):
        b, i, w = (statistics.median(samples[(op, stage)]) * 1e3 for op in "BIW")
        per_stage.append({"stage": stage, "B_ms": b, "I_ms": i, "W_ms": w, "ratio_I_plus_W_over_B": (i + w) / b})
    total = sum(s["I_ms"] + s["W_ms"] for s in per_stage) / sum(s["B_ms"] for s in per_stage)
    return {"runs": runs, "schedules": "1f1b (B) and zb-h1 (I, W), D=2, N=8, B=2",
            "stages": per_stage, "ratio_I_plus_W_over_B": total}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-bench")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3, help="pipeline runs of each schedule (0: skip)")
    ap.add_argument("--default-malloc", action="store_true",
                    help="leave glibc's malloc as it is (the runtime keeps freed memory)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.default_malloc:
        os.environ["CHIMERA_MALLOC"] = "default"  # for the spawned ranks too
    keep_freed_memory()  # as the runtime does (chimera.runtime.allocator)
    res = {"model": args.model, "malloc": "default" if args.default_malloc else "keep freed memory",
           "date": time.strftime("%Y-%m-%d %H:%M"), "load_average": os.getloadavg()}
    res["isolated"] = iso = isolated(args.model, args.blocks, args.reps)
    print(f"isolated: {args.model}, {args.blocks} blocks, micro-batch 2, 1 thread, median of "
          f"{args.reps}: B {iso['B_ms']:.1f} ms, I {iso['I_ms']:.1f} ms, W {iso['W_ms']:.1f} ms, "
          f"(I+W)/B = {iso['ratio_I_plus_W_over_B']:.3f}; I without the kept gradients and hooks "
          f"{iso['I_without_bookkeeping_ms']:.1f} ms")
    if args.runs:
        res["in_pipeline"] = run = in_pipeline(args.model, args.runs)
        for s in run["stages"]:
            print(f"in the pipeline, stage {s['stage']}: B {s['B_ms']:.1f} ms, I {s['I_ms']:.1f} ms, "
                  f"W {s['W_ms']:.1f} ms CPU, (I+W)/B = {s['ratio_I_plus_W_over_B']:.3f}")
        print(f"in the pipeline, both stages: (I+W)/B = {run['ratio_I_plus_W_over_B']:.3f}")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
