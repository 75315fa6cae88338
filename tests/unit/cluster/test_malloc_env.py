"""cluster/malloc_env.py: the glibc behaviour it answers, reproduced in a child Python. A freed 4 MiB
buffer raises glibc's dynamic mmap threshold; 64 buffers of 1 MiB then come from the heap, each followed
by a small live object, and once freed their pages stay resident. Under ``ENCODER_MALLOC_ENV`` and
the encoder's heap trim (encoder_service/heap_trim.py) the memory goes back to the kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from cluster.malloc_env import ENCODER_MALLOC_ENV
from encoder_service.heap_trim import HeapTrimmer

REPO = Path(__file__).resolve().parents[3]

CHILD = """
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
big = bytearray(4 << 20)
del big  # a freed mmap-ed block: the threshold rises to its size unless fixed
before = rss()
blocks, pins = [], []
for i in range(64):
    blocks.append(bytearray(1 << 20))  # written (zeroed): resident
    pins.append(bytes(600) + bytes([i]))  # a small malloc-ed object after it, still alive
del blocks
if TRIM:
    from encoder_service.heap_trim import glibc_trim
    glibc_trim()()
print(rss() - before)
"""


def _retained_mib(env: dict[str, str], trim: bool = False) -> float:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", f"TRIM = {trim}\n" + CHILD],
        env=base | env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=REPO,
    )
    return int(out.stdout) / 2**20


def test_freed_buffers_stay_resident_by_default_and_go_back_under_the_encoder_env_and_trim() -> None:
    assert _retained_mib({}) > 48  # of 64 MiB freed
    assert _retained_mib(ENCODER_MALLOC_ENV) > 48  # two arenas alone keep them
    assert _retained_mib(ENCODER_MALLOC_ENV, trim=True) < 8


def test_the_trimmer_trims_on_its_interval_until_stopped() -> None:
    calls: list[int] = []
    third = threading.Event()

    def trim() -> None:
        calls.append(1)
        if len(calls) == 3:
            third.set()

    trimmer = HeapTrimmer(trim, interval_s=0.01)
    assert third.wait(10)
    trimmer.stop()
    n = len(calls)
    assert not trimmer._thread.is_alive() and len(calls) == n
