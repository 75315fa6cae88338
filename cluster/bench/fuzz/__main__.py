"""``python -m cluster.bench.fuzz --target NAME --seconds N [--corpus DIR]``, or ``--all``."""

from __future__ import annotations

import sys

from cluster.bench.fuzz.runner import main

if __name__ == "__main__":
    sys.exit(main())
