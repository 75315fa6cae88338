"""A pool's CPU affinity (``deployment.cpu_affinity``): the cores its replicas' threads may run on.

On a CPU node, pinning each replica to cores of its own is how CPU serving keeps one replica's work
(a prefill's long forward) off another's cores (a decode replica's steps): vLLM's CPU backend binds its
OpenMP threads with ``VLLM_CPU_OMP_THREADS_BIND`` ("0-31|32-63", one set per rank). The same form here::

    "3"          one core                      "0-3"      a range       "0,2,4-5"   a list of both
    [0, 1]       the same as "0,1"              "0|1"      one set per replica: on each node the pool's
                                                           replicas take the sets in turn (the first
                                                           replica to start there "0", the next "1")

A replica applies it in its constructor (``pin_replica``): every thread the process has then
(``/proc/self/task``) is set to the cores, and a thread started later (torch's intra-op pool, which
starts at the first forward) inherits its creator's set. A replica claims its set with a lock file per
set on its node (``flock``: the kernel drops the lock when the process dies), so a replica that replaces
a dead one takes the freed set. More replicas on a node than sets: the extra ones share a set (a warning
says which). Parsing is pure (the config checks the form); the cores are checked on the replica's node,
where they must exist (``CpuAffinityError`` naming the pool and the core).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import IO

logger = logging.getLogger("mmserve.cpu_affinity")

CpuSets = tuple[frozenset[int], ...]
_PART = re.compile(r"^([0-9]+)(?:-([0-9]+))?$")
MAX_CORE = 65535  # past any node's core numbers; bounds the sets a config can make
_HELD: list[IO[bytes]] = []  # the lock files of this process's claimed sets, open while it lives


class CpuAffinityError(ValueError):
    """A cpu_affinity that cannot be applied: its form, or a core the node does not have."""


def parse_cpu_affinity(value: str | Iterable[int]) -> CpuSets:
    """``"0-3,5"`` / ``"0|1"`` / ``[0, 1]`` -> the sets of cores, one per ``|``-separated part."""
    if not isinstance(value, str):
        listed = list(value)
        if not listed or any(
            isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= MAX_CORE for c in listed
        ):
            raise CpuAffinityError(f"a list of cores must hold core numbers 0-{MAX_CORE}, got {listed}")
        return (frozenset(listed),)
    sets = []
    for group in value.split("|"):
        cores: set[int] = set()
        for part in group.replace(" ", "").split(","):
            m = _PART.match(part)
            if m is None:
                raise CpuAffinityError(
                    f"{value!r}: {part!r} is not a core or a range a-b (e.g. '0-3,5' or '0|1')"
                )
            lo, hi = int(m[1]), int(m[2] or m[1])
            if hi < lo:
                raise CpuAffinityError(f"{value!r}: the range {part!r} runs backwards")
            if hi > MAX_CORE:
                raise CpuAffinityError(f"{value!r}: core {hi} is past {MAX_CORE}")
            cores.update(range(lo, hi + 1))
        sets.append(frozenset(cores))
    return tuple(sets)


def format_cpus(cores: Iterable[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"`` (the kernel's cpu-list form)."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive cores
    for c in sorted(set(cores)):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def check_cores(sets: CpuSets, node_cores: Iterable[int], pool: str) -> None:
    """Every core of ``sets`` is one of ``node_cores`` (what this node lets the process use)."""
    have = set(node_cores)
    for cores in sets:
        missing = sorted(cores - have)
        if missing:
            raise CpuAffinityError(
                f"{pool}: cpu_affinity core {missing[0]} is not on this node (its cores: {format_cpus(have)})"
            )


def claim_set(sets: CpuSets, key: str, lock_dir: Path | None = None) -> int:
    """The index of the set this process takes among the pool ``key``'s replicas on this node: the first
    whose lock file no live process holds. All held: ``pid % len(sets)``, shared (a warning)."""
    if len(sets) == 1:
        return 0
    lock_dir = lock_dir or Path(tempfile.gettempdir()) / f"mmserve-cpu-affinity-{os.getuid()}"
    safe = re.sub(r"[^\w.-]", "_", key)
    try:
        lock_dir.mkdir(parents=True, exist_ok=True)
        for i in range(len(sets)):
            f = open(lock_dir / f"{safe}.{i}.lock", "wb")  # noqa: SIM115 - held open while the process lives
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            _HELD.append(f)
            return i
        why = "every cpu_affinity set is taken on this node"
    except OSError as e:  # no writable temp directory (a read-only root file system)
        why = f"the sets' lock files cannot be made in {lock_dir} ({e})"
    i = os.getpid() % len(sets)
    logger.warning("%s: %s; this replica takes set %d, which another may share", key, why, i)
    return i


def pin_process(cores: frozenset[int]) -> int:
    """Set every thread of this process to ``cores``; the number of threads set. Threads that start while
    it runs are caught by a second pass (they inherit from a thread already set, or are set then)."""
    done: set[int] = set()
    for _ in range(3):
        tids = {int(t) for t in os.listdir("/proc/self/task")} - done
        if not tids:
            break
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, cores)
            done.add(tid)
    return len(done)


def process_cpus() -> list[int]:
    """The cores any thread of this process may run on (the union of its threads' sets)."""
    cores: set[int] = set()
    for t in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            cores |= os.sched_getaffinity(int(t))
    return sorted(cores)


def pin_replica(value: str | list[int] | None, pool: str, key: str) -> frozenset[int] | None:
    """A replica's constructor: apply its pool's ``cpu_affinity`` (None: leave the threads as they are).
    ``pool`` names the pool in errors and logs, ``key`` tells one pool's lock files from another's."""
    if value is None:
        return None
    sets = parse_cpu_affinity(value)
    check_cores(sets, os.sched_getaffinity(0), pool)
    cores = sets[claim_set(sets, key)]
    n = pin_process(cores)
    logger.info("%s: %d threads pinned to cores %s", pool, n, format_cpus(cores))
    return cores
