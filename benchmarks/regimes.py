"""When does the bidirectional placement pay? The regime table (issue 36).

Per regime (balanced; head 1.5x and 2x under both cuts; link 0.2 F and 1 F with and without
a memory cap of D; replica and data-parallel allreduce at 0.5 and 2 F*N/D, the 2 F*N/D ones
also with the optimizer sharded; a head 1.5x in compute and gradients under a data-parallel
allreduce), every schedule of ours and of torch's simulated at the emulated bench's prices
(chimera.bench.regimes), the best of each side and torch / ours. Simulated columns are
deterministic; the realized ones run ``chimera bench --emulate`` once per regime (the W=2
ones with ``--data-parallel 2``: 2D ranks), one after another, so only on a quiet machine
(about 5 minutes a regime with --quick at D=8 N=16, 10 without; the W=2 and sharded ones
longer).

Usage: python benchmarks/regimes.py [-D 8] [-N 16] [--emulate 20:20:20] [--realized [--quick]]
       (writes regimes-D{D}-N{N}.md and .json and prints the README's short table; --out DIR,
       default out/)
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outdir import out_dir  # noqa: E402  (--out DIR, default out/)

from chimera.bench import regimes  # noqa: E402
from chimera.bench.rows import BenchConfig  # noqa: E402

OUT = out_dir()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-D", type=int, default=8)
    p.add_argument("-N", type=int, default=16)
    p.add_argument("--emulate", default="20:20:20", help="F:I:W ms per micro-batch per D-th")
    p.add_argument("--layers-per-stage", type=int, default=4)
    p.add_argument("--realized", action="store_true", help="also run the bench per regime")
    p.add_argument("--quick", action="store_true", help="--realized: the bench's --quick")
    args = p.parse_args()
    base = BenchConfig(emulate=args.emulate, stages=args.D, micro_batches=args.N,
                       layers_per_stage=args.layers_per_stage)
    rows = regimes.table(base)
    os.makedirs(OUT, exist_ok=True)
    if args.realized:
        regimes.realize(rows, base, args.quick, os.path.join(OUT, "regime-runs"))
    print(regimes.markdown(rows, base))
    print()
    print(regimes.markdown(rows, base, short=True))
    print("\nwrote " + ", ".join(regimes.write(rows, base, OUT)))


if __name__ == "__main__":
    main()
