"""cluster/malloc_env.py: the glibc behaviour it answers, reproduced in a child Python. A freed 4 MiB
buffer raises glibc's dynamic mmap threshold; 64 buffers of 1 MiB then come from the heap, each followed
by a small live object, and once freed their pages stay resident. Under ``ENCODER_MALLOC_ENV`` each
buffer is its own mapping and the memory goes back to the kernel."""

from __future__ import annotations

import os
import subprocess
import sys

from cluster.malloc_env import ENCODER_MALLOC_ENV

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
print(rss() - before)
"""


def _retained_mib(env: dict[str, str]) -> float:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=base | env, capture_output=True, text=True, check=True, timeout=60
    )
    return int(out.stdout) / 2**20


def test_freed_buffers_stay_resident_by_default_and_go_back_under_the_encoder_env() -> None:
    assert _retained_mib({}) > 48  # of 64 MiB freed
    assert _retained_mib(ENCODER_MALLOC_ENV) < 8
