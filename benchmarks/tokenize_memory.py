"""Memory and time of `chimera tokenize` as the text grows (issue 26: streaming tokenization).

Builds text files of the sizes asked for under --workdir (Python source from this machine's
site-packages, in sorted order, UTF-8 files only: real text of many words, made locally, no
download), runs `chimera tokenize --data FILE --vocab-size V --out DIR` on each in a fresh
process, and records its peak RSS (getrusage of the child) and wall time. Memory per byte of
text is the slope between the smallest and the largest size (the fixed cost of Python,
tokenizers and numpy drops out); a corpus held in memory would show a slope of 1 or more.

    python benchmarks/tokenize_memory.py --sizes-mb 10 100

writes OUT.json and OUT.md (--out, default out/tokenize_memory; the committed figures are
benchmarks/results/tokenize_memory, rewritten only by naming it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

MB = 10**6


def make_text(path: Path, size: int) -> None:
    """``size`` bytes of Python source from site-packages (whole files, the last one cut at a
    line end), written once."""
    if path.is_file() and path.stat().st_size == size:
        return
    root = Path(sysconfig.get_paths()["purelib"])
    written = 0
    with open(path, "wb") as out:
        for f in sorted(root.rglob("*.py")):
            data = f.read_bytes()
            if b"\0" in data:
                continue
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            data = data[:size - written]
            out.write(data)
            written += len(data)
            if written >= size:
                break
    if written < size:
        raise SystemExit(f"only {written:,} bytes of Python source under {root}: ask for less")


def run_once(text: Path, out: Path, vocab: int, tokenizer: Path | None = None) -> dict:
    """One `chimera tokenize` in a child process (training a BPE, or with ``tokenizer``
    encoding only): its peak RSS and wall time."""
    shutil.rmtree(out, ignore_errors=True)
    how = ["--vocab-size", str(vocab)] if tokenizer is None else ["--tokenizer", str(tokenizer)]
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "chimera", "tokenize", "--data", str(text),
                              *how, "--out", str(out), "--no-progress"])
    _, status, usage = os.wait4(child.pid, 0)  # this child's own peak RSS (KiB on Linux)
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if child.returncode:
        raise SystemExit(f"chimera tokenize failed on {text} (exit {child.returncode})")
    meta = json.loads((out / "meta.json").read_text())
    return {"mode": "train BPE + encode" if tokenizer is None else "encode only",
            "bytes": text.stat().st_size, "wall_s": round(wall, 2),
            "peak_rss_bytes": usage.ru_maxrss * 1024, "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "tokens": meta["tokens"]["train"] + meta["tokens"]["val"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[10, 100])
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--workdir", default="/tmp/chimera-tokenize-bench")
    ap.add_argument("--out", default="out/tokenize_memory")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    sizes = sorted(args.sizes_mb)
    rows, encode = [], []
    for mb in sizes:
        text = work / f"text-{mb}MB.txt"
        make_text(text, mb * MB)
        rows.append(run_once(text, work / f"tok-{mb}MB", args.vocab_size))
        print(json.dumps(rows[-1]), flush=True)
    for mb in sizes:  # the smallest run's tokenizer: the streaming of ids alone
        encode.append(run_once(work / f"text-{mb}MB.txt", work / f"enc-{mb}MB", args.vocab_size,
                               work / f"tok-{sizes[0]}MB" / "tokenizer.json"))
        print(json.dumps(encode[-1]), flush=True)
    result = {"command": f"chimera tokenize --data FILE --vocab-size {args.vocab_size} --out DIR "
                         "(encode only: --tokenizer FILE instead of --vocab-size)",
              "cpus": os.cpu_count(), "rows": rows + encode,
              "rss_bytes_per_text_byte": _slope(rows), "encode_rss_bytes_per_text_byte": _slope(encode)}
    rows = rows + encode
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["| run | text | tokens | wall | CPU | peak RSS | RSS / text byte |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['bytes'] / MB:.0f} MB | {r['tokens']:,} | {r['wall_s']:.1f} s | {r['cpu_s']:.0f} s | "
                     f"{r['peak_rss_bytes'] / 2**20:.0f} MiB | {r['peak_rss_bytes'] / r['bytes']:.2f} |")
    if len(sizes) > 1:
        lines.append(f"\nmemory per extra byte of text ({sizes[0]} to {sizes[-1]} MB): "
                     f"{result['rss_bytes_per_text_byte']:.2f} bytes training a BPE and encoding, "
                     f"{result['encode_rss_bytes_per_text_byte']:.2f} bytes encoding only")
    Path(args.out + ".md").write_text(f"`{result['command']}`, {os.cpu_count()} CPUs\n\n"
                                      + "\n".join(lines) + "\n")
    print("\n".join(lines))


def _slope(rows: list[dict]) -> float | None:
    """Peak RSS per byte of text between the smallest and the largest run."""
    if len(rows) < 2:
        return None
    return (rows[-1]["peak_rss_bytes"] - rows[0]["peak_rss_bytes"]) / (rows[-1]["bytes"] - rows[0]["bytes"])


if __name__ == "__main__":
    main()
