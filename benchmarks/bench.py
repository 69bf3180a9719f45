"""Our runtime against torch.distributed.pipelining: `python benchmarks/bench.py [--quick]`.

The same as `chimera bench`; results go to out/bench.{json,md,png} (--out DIR).
"""

import sys

from chimera.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
