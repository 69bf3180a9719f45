"""Decoding speed of `chimera generate` with its key/value cache, against one forward of the
whole window per token (what it did before): the same model, the same greedy tokens.

The model is a preset with untrained weights (speed does not depend on them); the prompt is
8 tokens and the new tokens stop before the context is full (beyond it both run the window).

    python benchmarks/generate_speed.py --model gpt2-bench --new 112

writes OUT.json and OUT.md (--out, default out/generate_speed; the committed figures are
benchmarks/results/generate_speed, rewritten only by naming it).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from chimera.data.formats import DataInfo
from chimera.train.generate import Loaded, Settings, sample
from chimera.train.sources import open_source


def windowed(loaded: Loaded, prompt: list[int], new: int) -> list[int]:
    """Greedy without a cache: the whole window through the model for every token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            window = torch.tensor([ids[-loaded.context:]])
            ids.append(int(loaded.model(window)[0, -1].argmax()))
    return ids[len(prompt):]


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-bench")
    ap.add_argument("--new", type=int, default=112)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="out/generate_speed")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    source = open_source(args.model, DataInfo("bin", 256, False, False))
    loaded = Loaded(source.whole(seed=0).eval(), source.seq_len, 256, {}, None, source)
    prompt = list(b"def main")
    cached_s, cached = timed(lambda: sample(loaded, [prompt], Settings(args.new, temperature=0))[0])
    window_s, plain = timed(lambda: windowed(loaded, prompt, args.new))
    result = {"model": args.model, "context": source.seq_len, "prompt": len(prompt),
              "new_tokens": args.new, "threads": args.threads, "same_tokens": cached == plain,
              "cached_s": round(cached_s, 3), "window_s": round(window_s, 3),
              "speedup": round(window_s / cached_s, 2)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    table = (f"| model | context | new tokens | key/value cache | window per token | speed-up | same tokens |\n"
             f"|---|---|---|---|---|---|---|\n"
             f"| {args.model} | {source.seq_len} | {args.new} | {cached_s:.2f} s | {window_s:.2f} s | "
             f"{window_s / cached_s:.1f}x | {cached == plain} |\n")
    Path(args.out + ".md").write_text(f"`python benchmarks/generate_speed.py --model {args.model} "
                                      f"--new {args.new}`, {args.threads} thread(s)\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
