"""What a process's resident memory is made of, from ``/proc/PID/smaps``: the soak's "which mappings grow".

Each mapping's ``Rss`` goes to one class:

- ``shm``: shared memory (``/dev/shm``, ``memfd:``; Ray's object store is mapped into every worker that
  reads or writes an object, and each page a worker touches counts in its RSS);
- ``file``: other file-backed pages (code and data of shared libraries, mmapped model files);
- ``heap``: the main glibc arena (``[heap]``, grown by ``brk``);
- ``arena``: glibc's per-thread arenas: anonymous mappings that start on a 64 MiB boundary, each one
  64 MiB "heap" of an arena (``HEAP_MAX_SIZE``; a thread that mallocs while the main arena is locked gets
  an arena of its own, up to 8 per core, and an arena grows by further heaps); ``arena_heaps`` counts them;
- ``anon``: other anonymous memory (``mmap``-ed large blocks: tensors, numpy arrays, thread stacks).

``threads`` is the process's thread count (``/proc/PID/status``): a pool that keeps spawning shows here,
and ``thread_names`` which (``/proc/PID/task/*/comm``, counted by name with its trailing digits dropped).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from cluster.bench.procs import PROC

ARENA_ALIGN = 64 * 1024 * 1024  # glibc's HEAP_MAX_SIZE on 64-bit: every non-main arena starts aligned
CLASSES = ("shm", "file", "heap", "arena", "anon")
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ (\d+)\s*(.*)$")


@dataclass(frozen=True)
class MemBreakdown:
    """Resident KiB by class (``CLASSES``), the arena heaps holding resident pages, and threads, of one process at one instant."""

    kib: dict[str, int]
    arena_heaps: int
    threads: int
    thread_names: Counter[str] = field(default_factory=Counter)

    @property
    def total_kib(self) -> int:
        return sum(self.kib.values())


def mapping_class(start: int, inode: int, path: str) -> str:
    """The class (see the module) of a mapping from its smaps header's start address, inode and path."""
    if path.startswith(("/dev/shm/", "/memfd:", "/SYSV")):
        return "shm"
    if path == "[heap]":
        return "heap"
    if inode != 0 or path.startswith("/"):
        return "file"
    if path == "" and start % ARENA_ALIGN == 0:
        return "arena"
    return "anon"


def parse_smaps(text: str) -> tuple[dict[str, int], int]:
    """``/proc/PID/smaps`` -> (resident KiB by class, arena heaps with resident pages)."""
    kib = dict.fromkeys(CLASSES, 0)
    arena_heaps = 0
    cls = "anon"
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            start, inode, path = int(m.group(1), 16), int(m.group(4)), m.group(5).strip()
            cls = mapping_class(start, inode, path)
            continue
        if line.startswith("Rss:"):
            rss = int(line.split()[1])
            kib[cls] += rss
            if cls == "arena" and rss:
                arena_heaps += 1
    return kib, arena_heaps


def parse_threads(status: str) -> int:
    for line in status.splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise ValueError("no Threads: line in /proc/PID/status")


def read_breakdown(pid: int) -> MemBreakdown | None:
    """``pid``'s resident memory by class now, or None when it is gone or unreadable."""
    try:
        smaps = (PROC / str(pid) / "smaps").read_text()
        status = (PROC / str(pid) / "status").read_text()
    except OSError:
        return None
    kib, arena_heaps = parse_smaps(smaps)
    return MemBreakdown(kib, arena_heaps, parse_threads(status), thread_names(pid))


def thread_names(pid: int) -> Counter[str]:
    """``pid``'s threads by name, trailing digits dropped (``ThreadPoolExecutor-0_3`` -> ``ThreadPoolExecutor-0_``)."""
    names: Counter[str] = Counter()
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:
        return names
    for task in tasks:
        try:
            names[(task / "comm").read_text().strip().rstrip("0123456789")] += 1
        except OSError:
            continue
    return names


def breakdown_row(t_s: float, kind: str, pid: int, b: MemBreakdown) -> dict[str, object]:
    """One CSV row: time, process, then MiB per class, arena heaps and threads."""
    row: dict[str, object] = {"t_s": round(t_s, 1), "kind": kind, "pid": pid}
    row |= {f"{c}_mib": round(b.kib[c] / 1024, 1) for c in CLASSES}
    row |= {"total_mib": round(b.total_kib / 1024, 1), "arena_heaps": b.arena_heaps, "threads": b.threads}
    row["thread_names"] = " ".join(f"{n}={c}" for n, c in sorted(b.thread_names.items()))
    return row
