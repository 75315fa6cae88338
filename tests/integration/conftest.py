"""Integration tests start Ray and Serve in this process.

Serve reads its settings (``cluster/serve_env.py``) when ``ray.serve`` is imported. Imported here,
before any fixture applies mmserve's settings, this test process, which calls handles synchronously,
keeps Serve's defaults, and only the processes Ray starts get mmserve's: the same in a whole-suite run
and in one module run alone (``tests/integration/test_faults.py`` alone failed without it: a sync
handle call's router coroutine was never awaited).
"""

import ray.serve  # noqa: F401
