"""The README's scheme table (simulated bubbles and memory beside the paper's formulas).

Usage: python benchmarks/scheme_table.py [D N]   (writes benchmarks/results/scheme_table_D{D}_N{N}.md)
"""

import os
import sys

from chimera.theory.tables import scheme_table


def main():
    d, n = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) == 3 else (8, 16)
    table = scheme_table(d, n)
    print(table)
    out = os.path.join(os.path.dirname(__file__), "results", f"scheme_table_D{d}_N{n}.md")
    with open(out, "w") as f:
        f.write(table + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
