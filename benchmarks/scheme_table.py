"""The README's scheme table (simulated bubbles and memory beside the paper's formulas).

Usage: python benchmarks/scheme_table.py [D N]   (writes out/scheme_table_D{D}_N{N}.md; --out DIR)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outdir import out_dir  # noqa: E402  (--out DIR, default out/)

from chimera.theory.tables import scheme_table  # noqa: E402

OUT = out_dir()


def main():
    d, n = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) == 3 else (8, 16)
    table = scheme_table(d, n)
    print(table)
    os.makedirs(OUT, exist_ok=True)
    out = os.path.join(OUT, f"scheme_table_D{d}_N{n}.md")
    with open(out, "w") as f:
        f.write(table + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
