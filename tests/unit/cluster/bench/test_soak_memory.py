"""cluster/bench/soak_memory.py: a process's resident memory by class from a hand-written smaps, and
from this very process's /proc."""

from __future__ import annotations

import os
import threading

from cluster.bench.soak_memory import ARENA_ALIGN, mapping_class, parse_smaps, parse_threads, read_breakdown

SMAPS = """\
55d0c0a00000-55d0c0c00000 rw-p 00000000 00:00 0                          [heap]
Size:               2048 kB
Rss:                1500 kB
7f2c04000000-7f2c06000000 rw-p 00000000 00:00 0
Size:              32768 kB
Rss:               30000 kB
7f2c06000000-7f2c08000000 ---p 00000000 00:00 0
Size:              32768 kB
Rss:                   0 kB
7f2c08001000-7f2c08201000 rw-p 00000000 00:00 0
Size:               2048 kB
Rss:                 700 kB
7f2c10000000-7f2c10100000 r-xp 00000000 08:01 1234                       /usr/lib/libtorch_cpu.so
Size:               1024 kB
Rss:                 400 kB
7f2c20000000-7f2c30000000 rw-s 00000000 00:1a 99                         /dev/shm/plasma-abc (deleted)
Size:             262144 kB
Rss:                8000 kB
"""


def test_each_mapping_goes_to_its_class() -> None:
    kib, arena_heaps = parse_smaps(SMAPS)
    # the 64 MiB-aligned anonymous mapping is an arena; its ---p reserve holds nothing resident
    assert kib == {"shm": 8000, "file": 400, "heap": 1500, "arena": 30000, "anon": 700}
    assert arena_heaps == 1


def test_an_anonymous_mapping_off_the_arena_alignment_is_plain_anon() -> None:
    assert mapping_class(ARENA_ALIGN, 0, "") == "arena"
    assert mapping_class(ARENA_ALIGN + 4096, 0, "") == "anon"
    assert mapping_class(ARENA_ALIGN, 0, "[stack]") == "anon"
    assert mapping_class(ARENA_ALIGN, 77, "/x.so") == "file"


def test_threads_line() -> None:
    assert parse_threads("Name:\tpython\nThreads:\t7\nSigQ:\t0/1\n") == 7


def test_a_second_thread_that_mallocs_shows_in_threads_and_the_breakdown_sums_to_rss() -> None:
    started, done = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        done.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    started.wait(10)
    b = read_breakdown(os.getpid())
    done.set()
    t.join()
    assert b is not None and b.threads >= 2
    with open(f"/proc/{os.getpid()}/smaps_rollup") as f:
        rollup_kib = next(int(line.split()[1]) for line in f if line.startswith("Rss:"))
    assert abs(b.total_kib - rollup_kib) < 0.1 * rollup_kib  # the same pages, a moment apart
