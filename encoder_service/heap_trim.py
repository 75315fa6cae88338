"""A preparing encoder replica's heap given back to the kernel once a second (glibc ``malloc_trim``).

Why (measured: docs/benchmark-log.md, soak runs S3-S5 and run AW): the preparing threads decode images
and audio into 0.1-30 MiB buffers. glibc serves the first ones with their own ``mmap``, but freeing one
raises its mmap threshold to that size, so later buffers come from the heap and per-thread arenas,
whose freed pages stay resident: each encoder's RSS grew by 0.7-1.4 GiB over its first minutes under
load. Two fixes were measured on the same images: a fixed 128 KiB mmap threshold
(``MALLOC_MMAP_THRESHOLD_``) keeps RSS flat but costs ~55 % more CPU per image (a fresh mapping and
its page faults for every large buffer); two arenas (``MALLOC_ARENA_MAX=2``, cluster/malloc_env.py)
and this trim once a second keep the fast path and return the freed pages, at no measurable CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable

logger = logging.getLogger("mmserve.encoder")

TRIM_INTERVAL_S = 1.0


def glibc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)`` (every arena's free pages back to the kernel), or None elsewhere."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class HeapTrimmer:
    """``trim()`` every ``interval_s`` on a daemon thread until ``stop()``."""

    def __init__(self, trim: Callable[[], object], interval_s: float = TRIM_INTERVAL_S) -> None:
        self._trim, self.interval_s = trim, interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heap-trim", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            try:
                self._trim()
            except Exception:  # never the replica's concern: log once and stop trimming
                logger.exception("heap trim failed; not trimming any more")
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)


def start_heap_trimmer(interval_s: float = TRIM_INTERVAL_S) -> HeapTrimmer | None:
    """A running trimmer, or None where the C library has no ``malloc_trim``."""
    trim = glibc_trim()
    return None if trim is None else HeapTrimmer(trim, interval_s)
