"""The machine's processes as ``/proc`` shows them: CPU time, parent, title; which ones make one Ray cluster.

Linux only, read straight from ``/proc`` (no psutil). A process's CPU time is ``utime + stime`` of
``/proc/PID/stat``: every thread of it, in clock ticks. Ray workers rename themselves (``ray::Class``),
so ``/proc/PID/cmdline`` is the title an actor's process has while it lives.

One Ray cluster on this machine is its raylet's descendants (the workers: Serve replicas, actors,
the dashboard and runtime-env agents), every process whose command line names the cluster's session
directory (GCS server, raylet, dashboard, log monitor, autoscaler monitor) and the raylet's parent, the
driver that started the cluster (``mmserve serve``, or the benchmark itself when it embeds the app).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
TCP_LISTEN = "0A"  # the socket state column of /proc/net/tcp
TCP_ESTABLISHED = "01"


@dataclass(frozen=True)
class ProcInfo:
    """One process at one instant."""

    pid: int
    ppid: int
    start_ticks: int  # since boot: tells a process from a later one that reuses its pid
    cpu_ticks: int  # utime + stime, all threads
    title: str  # the command line, NULs as spaces, trailing padding stripped

    @property
    def cpu_s(self) -> float:
        return self.cpu_ticks / CLOCK_TICKS_PER_S


def parse_stat(text: str) -> tuple[int, int, int]:
    """``/proc/PID/stat`` -> (ppid, utime + stime, starttime), ticks; the name may hold ``)`` and spaces."""
    close = text.rfind(")")
    if close < 0:
        raise ValueError(f"not a /proc/PID/stat line: {text[:80]!r}")
    fields = text[close + 2 :].split()
    # fields[0] is field 3 (state) of proc(5): ppid is field 4, utime 14, stime 15, starttime 22.
    try:
        return int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19])
    except (IndexError, ValueError) as e:
        raise ValueError(f"/proc/PID/stat line has too few numeric fields: {text[:80]!r}") from e


def read_proc(pid: int) -> ProcInfo | None:
    """The process now, or None when it is gone (or is a kernel thread, which has no command line)."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    if not raw:
        return None
    ppid, ticks, start = parse_stat(stat)
    title = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return ProcInfo(pid=pid, ppid=ppid, start_ticks=start, cpu_ticks=ticks, title=title)


def list_procs(pids: Iterable[int] | None = None) -> dict[int, ProcInfo]:
    """Every process of the machine (or only ``pids``) that can be read now."""
    if pids is None:
        pids = (int(p.name) for p in PROC.iterdir() if p.name.isdigit())
    return {p.pid: p for pid in pids if (p := read_proc(pid)) is not None}


# -- one Ray cluster ----------------------------------------------------------------------------------


def is_raylet(title: str) -> bool:
    first = title.split(" ", 1)[0]
    return first.endswith("/raylet") or first == "raylet"


def children_of(procs: dict[int, ProcInfo]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for p in procs.values():
        kids.setdefault(p.ppid, []).append(p.pid)
    return kids


def descendants(procs: dict[int, ProcInfo], root: int) -> set[int]:
    """``root``'s children, their children, ... (not ``root`` itself)."""
    kids = children_of(procs)
    found: set[int] = set()
    todo = list(kids.get(root, []))
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += kids.get(pid, [])
    return found


def find_raylet(procs: dict[int, ProcInfo], pid: int) -> int | None:
    """The raylet above ``pid`` (a worker), or among ``pid``'s descendants (a driver); None if neither."""
    seen: set[int] = set()
    cur: int | None = pid
    while cur is not None and cur in procs and cur not in seen:
        if is_raylet(procs[cur].title):
            return cur
        seen.add(cur)
        cur = procs[cur].ppid
    below = sorted(d for d in descendants(procs, pid) if is_raylet(procs[d].title))
    return below[0] if below else None


SESSION_RE = re.compile(r"(session_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+_\d+)")
GCS_RE = re.compile(r"--gcs[-_]address=(\S+)")


def session_name(title: str) -> str | None:
    """``session_2026-12-01_02-49-56_924887_11751`` from a Ray system process's command line."""
    m = SESSION_RE.search(title)
    return m.group(1) if m else None


def gcs_address(title: str) -> str | None:
    """``127.0.0.1:36643`` from a raylet's (or monitor's) command line."""
    m = GCS_RE.search(title)
    return m.group(1) if m else None


def cluster_members(procs: dict[int, ProcInfo], raylet: int) -> set[int]:
    """The pids of the raylet's cluster: see the module's docstring."""
    members = {raylet} | descendants(procs, raylet)
    session = session_name(procs[raylet].title)
    if session is not None:
        members |= {p.pid for p in procs.values() if session in p.title}
    driver = procs[raylet].ppid
    if driver in procs and driver != 1:
        members.add(driver)
    return members


def listening_inodes(tcp_table: str, port: int) -> set[int]:
    """Socket inodes listening on ``port`` in a ``/proc/net/tcp`` (or ``tcp6``) table."""
    inodes: set[int] = set()
    for line in tcp_table.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10 or cols[3] != TCP_LISTEN:
            continue
        local_port = int(cols[1].rsplit(":", 1)[1], 16)
        if local_port == port:
            inodes.add(int(cols[9]))
    return inodes


def connections_to(tcp_table: str, port: int) -> int:
    """Established connections whose remote end is ``port``, in a ``/proc/net/tcp`` (or ``tcp6``) table."""
    n = 0
    for line in tcp_table.splitlines()[1:]:
        cols = line.split()
        if len(cols) >= 4 and cols[3] == TCP_ESTABLISHED and int(cols[2].rsplit(":", 1)[1], 16) == port:
            n += 1
    return n


def anyone_connected_to(port: int) -> bool:
    """Some process on this machine holds an established TCP connection to ``port``."""
    for name in ("tcp", "tcp6"):
        try:
            if connections_to((PROC / "net" / name).read_text(), port):
                return True
        except OSError:
            continue
    return False


def pid_listening_on(port: int) -> int | None:
    """The process with a socket listening on TCP ``port`` on this machine (lowest pid), or None."""
    inodes: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            inodes |= listening_inodes((PROC / "net" / name).read_text(), port)
        except OSError:
            continue
    if not inodes:
        return None
    wanted = {f"socket:[{i}]" for i in inodes}
    for pid in sorted(int(p.name) for p in PROC.iterdir() if p.name.isdigit()):
        try:
            fds = list((PROC / str(pid) / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in wanted:
                    return pid
            except OSError:
                continue
    return None
