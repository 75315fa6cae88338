"""``python -m cluster.bench``: the serving benchmark (``cluster/bench/serving.py``)."""

import sys

from cluster.bench.serving import main

if __name__ == "__main__":
    sys.exit(main())
