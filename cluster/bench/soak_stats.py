"""Pure figures of a soak run (``cluster/bench/soak.py`` drives the load and feeds these): one sample of
every process of the app each minute (resident memory, open file descriptors), the object store's use,
and whether any of it grew.

    ── baseline ──┬──────────────── load (80 % of capacity) ────────────────┬── quiet ──▶ time
                  │            │ minute 5                                  │           │ end
                  │            └ the reference: warm-up (first requests, caches
                  │              filling, lazy imports) is over
                  └ the object store's baseline: it must return to it after the load

A process's RSS counts the object store's pages it has touched (shared memory: the raylet, which hosts
the store, touches a page of it each time its allocator first places an object there, up to the store's
high-water mark); the store is measured on its own, so growth is also given without them ("private").

A process is known by ``(pid, start ticks)``: a replica that Serve replaced is a new process, reported
apart (it did not grow; it was born). Growth is relative: ``(end - ref) / ref``.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cluster.bench.procs import PROC, ProcInfo
from cluster.bench.stats import markdown_table

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
MIB = 1024 * 1024
RSS_GROWTH_LIMIT = 0.05  # the bar: < 5 % between minute 5 and the end
STORE_SLACK_BYTES = 1 * MIB  # "back to baseline": within a MiB of it


@dataclass(frozen=True)
class ProcMem:
    """One process at one instant: who it is and what it holds."""

    pid: int
    start_ticks: int
    kind: str
    rss_bytes: int
    open_fds: int
    shm_bytes: int = 0  # of rss_bytes, shared-memory pages (the object store's)

    @property
    def private_bytes(self) -> int:
        return self.rss_bytes - self.shm_bytes

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.start_ticks)


@dataclass(frozen=True)
class StoreUse:
    """The object store (plasma) of the node: bytes and objects held."""

    used_bytes: int
    num_objects: int


@dataclass(frozen=True)
class Sample:
    t_s: float  # since the start of the run
    phase: str  # "baseline" | "load" | "quiet"
    procs: tuple[ProcMem, ...]
    store: StoreUse | None
    cache_entries: int | None = (
        None  # encoder-cache entries (all models' shards): what the store holds by design
    )


def parse_statm_rss(text: str) -> int:
    """``/proc/PID/statm`` -> resident bytes (its second field is resident pages)."""
    fields = text.split()
    if len(fields) < 2:
        raise ValueError(f"not a /proc/PID/statm line: {text[:80]!r}")
    return int(fields[1]) * PAGE_BYTES


def parse_status_shmem(text: str) -> int:
    """``/proc/PID/status`` -> its ``RssShmem`` in bytes (resident shared-memory pages; 0 if absent)."""
    for line in text.splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    return 0


def read_mem(pid: int) -> tuple[int, int, int] | None:
    """(RSS bytes, open fds, shared-memory bytes of the RSS) of ``pid`` now, or None when it is gone."""
    try:
        rss = parse_statm_rss((PROC / str(pid) / "statm").read_text())
        fds = len(os.listdir(PROC / str(pid) / "fd"))
        shm = parse_status_shmem((PROC / str(pid) / "status").read_text())
    except OSError:
        return None
    return rss, fds, shm


def sample_procs(procs: Mapping[int, ProcInfo], kind_of: Mapping[int, str]) -> tuple[ProcMem, ...]:
    """A ``ProcMem`` of each of ``procs`` still alive, its kind from ``kind_of`` (pid -> kind)."""
    out = []
    for pid, p in sorted(procs.items()):
        got = read_mem(pid)
        if got is not None:
            out.append(ProcMem(pid, p.start_ticks, kind_of.get(pid, "?"), got[0], got[1], got[2]))
    return tuple(out)


# -- growth -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Growth:
    """One process from the reference sample to the last sample it was in."""

    pid: int
    kind: str
    rss_ref: int
    rss_end: int
    fds_ref: int
    fds_end: int
    ended: bool  # gone before the last sample
    shm_ref: int = 0
    shm_end: int = 0

    @property
    def rss_growth(self) -> float:
        return (self.rss_end - self.rss_ref) / self.rss_ref if self.rss_ref else 0.0

    @property
    def private_growth(self) -> float:
        """Growth of the RSS less its shared-memory (object store) pages."""
        ref, end = self.rss_ref - self.shm_ref, self.rss_end - self.shm_end
        return (end - ref) / ref if ref else 0.0

    @property
    def fd_growth(self) -> int:
        return self.fds_end - self.fds_ref


def reference_sample(samples: Sequence[Sample], ref_s: float) -> Sample:
    """The first load sample taken ``ref_s`` or later into the run (minute 5); the last load sample
    when the load was shorter."""
    load = [s for s in samples if s.phase == "load"]
    if not load:
        raise ValueError("no sample was taken under load")
    return next((s for s in load if s.t_s >= ref_s), load[-1])


def growth(samples: Sequence[Sample], ref_s: float) -> tuple[list[Growth], list[ProcMem]]:
    """Each process of the reference sample against its last sample, and the processes born after the
    reference (their first sample)."""
    ref = reference_sample(samples, ref_s)
    last: dict[tuple[int, int], ProcMem] = {}
    born: dict[tuple[int, int], ProcMem] = {}
    at_ref = {p.key for p in ref.procs}
    for s in samples:
        if s.t_s < ref.t_s:
            continue
        for p in s.procs:
            last[p.key] = p
            if p.key not in at_ref:
                born.setdefault(p.key, p)
    final = {p.key for p in samples[-1].procs}
    rows = [
        Growth(
            p.pid,
            p.kind,
            p.rss_bytes,
            last[p.key].rss_bytes,
            p.open_fds,
            last[p.key].open_fds,
            p.key not in final,
            p.shm_bytes,
            last[p.key].shm_bytes,
        )
        for p in ref.procs
    ]
    return rows, list(born.values())


@dataclass(frozen=True)
class Verdict:
    worst_rss_growth: float
    worst_rss_kind: str
    fd_growth: int  # summed over the processes alive at both ends
    store_baseline: int | None
    store_after: int | None
    worst_private_growth: float = 0.0  # RSS less the object store's pages
    worst_private_kind: str = "-"

    @property
    def rss_ok(self) -> bool:
        return self.worst_rss_growth < RSS_GROWTH_LIMIT

    @property
    def private_ok(self) -> bool:
        return self.worst_private_growth < RSS_GROWTH_LIMIT

    @property
    def fds_ok(self) -> bool:
        return self.fd_growth <= 0

    @property
    def store_ok(self) -> bool:
        if self.store_baseline is None or self.store_after is None:
            return False
        return self.store_after <= self.store_baseline + STORE_SLACK_BYTES


def verdict(samples: Sequence[Sample], ref_s: float) -> Verdict:
    rows, _ = growth(samples, ref_s)
    alive = [g for g in rows if not g.ended]
    worst = max(alive, key=lambda g: g.rss_growth, default=None)
    worst_private = max(alive, key=lambda g: g.private_growth, default=None)
    base = [s.store for s in samples if s.phase == "baseline" and s.store is not None]
    after = [s.store for s in samples if s.phase == "quiet" and s.store is not None]
    return Verdict(
        worst.rss_growth if worst else 0.0,
        worst.kind if worst else "-",
        sum(g.fd_growth for g in alive),
        base[-1].used_bytes if base else None,
        after[-1].used_bytes if after else None,
        worst_private.private_growth if worst_private else 0.0,
        worst_private.kind if worst_private else "-",
    )


# -- output ---------------------------------------------------------------------------------------------

CSV_HEADER = (
    "t_s",
    "phase",
    "series",
    "pid",
    "kind",
    "rss_mib",
    "open_fds",
    "shm_mib",
    "store_mib",
    "store_objects",
    "cache_entries",
)


def csv_rows(s: Sample) -> list[list[object]]:
    """A sample's CSV rows: one per process (``series`` = ``proc``) and one for the store (with the
    encoder cache's entries beside it)."""
    t = f"{s.t_s:.1f}"
    rows: list[list[object]] = []
    for p in s.procs:
        rss, shm = f"{p.rss_bytes / MIB:.2f}", f"{p.shm_bytes / MIB:.2f}"
        rows.append([t, s.phase, "proc", p.pid, p.kind, rss, p.open_fds, shm, "", "", ""])
    if s.store is not None:
        entries = "" if s.cache_entries is None else s.cache_entries
        used = f"{s.store.used_bytes / MIB:.2f}"
        rows.append([t, s.phase, "store", "", "object store", "", "", "", used, s.store.num_objects, entries])
    return rows


def to_csv(samples: Iterable[Sample]) -> str:
    """The samples' rows (``csv_rows``) under ``CSV_HEADER``: what ``soak.csv`` holds."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_HEADER)
    for s in samples:
        w.writerows(csv_rows(s))
    return buf.getvalue()


def from_csv(text: str) -> list[Sample]:
    """The samples of ``to_csv``'s text (a run's CSV plotted or checked again later)."""
    rows = list(csv.DictReader(io.StringIO(text)))
    order: list[tuple[float, str]] = []
    procs: dict[tuple[float, str], list[ProcMem]] = {}
    stores: dict[tuple[float, str], tuple[StoreUse, int | None]] = {}
    for r in rows:
        key = (float(r["t_s"]), r["phase"])
        if key not in procs:
            order.append(key)
            procs[key] = []
        if r["series"] == "proc":
            rss = round(float(r["rss_mib"]) * MIB)
            shm = round(float(r.get("shm_mib") or 0) * MIB)
            procs[key].append(ProcMem(int(r["pid"]), 0, r["kind"], rss, int(r["open_fds"]), shm))
        else:
            entries = int(r["cache_entries"]) if r.get("cache_entries") else None
            stores[key] = (StoreUse(round(float(r["store_mib"]) * MIB), int(r["store_objects"])), entries)
    out = []
    for t, ph in order:
        store, entries = stores.get((t, ph), (None, None))
        out.append(Sample(t, ph, tuple(procs[(t, ph)]), store, entries))
    return out


def growth_table(samples: Sequence[Sample], ref_s: float) -> str:
    rows, born = growth(samples, ref_s)
    body = [
        [
            g.kind,
            str(g.pid),
            f"{g.rss_ref / MIB:.1f}",
            f"{g.rss_end / MIB:.1f}",
            f"{100 * g.rss_growth:+.1f} %",
            f"{g.shm_ref / MIB:.1f} → {g.shm_end / MIB:.1f}",
            f"{100 * g.private_growth:+.1f} %",
            f"{g.fds_ref} → {g.fds_end}",
            "exited" if g.ended else "",
        ]
        for g in sorted(rows, key=lambda g: -g.rss_ref)
    ]
    body += [
        [p.kind, str(p.pid), "-", f"{p.rss_bytes / MIB:.1f}", "born later", "", "", f"{p.open_fds}", ""]
        for p in born
    ]
    return markdown_table(
        [
            "process",
            "pid",
            "RSS at ref (MiB)",
            "RSS at end (MiB)",
            "growth",
            "of it object store (MiB)",
            "growth without it",
            "fds",
            "",
        ],
        body,
    )


class CsvLog:
    """A CSV file written as the rows come: each ``append`` opens it, writes and closes it (flushed), so
    a run killed midway keeps every sample taken. The first rows' keys are the header."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fieldnames: list[str] | None = None

    def append(self, rows: Sequence[Mapping[str, object]]) -> None:
        if not rows:
            return
        first = self.fieldnames is None
        if self.fieldnames is None:
            self.fieldnames = list(rows[0])
        with self.path.open("w" if first else "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.fieldnames, lineterminator="\n")
            if first:
                w.writeheader()
            w.writerows(rows)
