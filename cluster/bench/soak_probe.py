"""The soak's sampler (``cluster/bench/soak.py`` calls it each minute): every process of the app under
``mmserve serve`` (its RSS and open fds, and what the RSS is made of: ``cluster/bench/soak_memory.py``),
the object store's use asked of the raylet, and the encoder caches' entries from ``GET /stats``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cluster.bench.cpu_profile import process_kind
from cluster.bench.procs import cluster_members, find_raylet, gcs_address, list_procs
from cluster.bench.servers import ServerProcess
from cluster.bench.soak_memory import breakdown_row, read_breakdown
from cluster.bench.soak_stats import CSV_HEADER, CsvLog, Sample, StoreUse, csv_rows, sample_procs


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class AppProbe:
    """Reads the app's processes (the cluster of the raylet under ``mmserve serve``) and its store."""

    server: ServerProcess
    t0: float = field(default_factory=time.monotonic)
    out_dir: Path | None = None  # where each sample is appended: soak.csv, soak_memory.csv
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.csv = CsvLog(self.out_dir / "soak.csv") if self.out_dir else None
        self.memory_csv = CsvLog(self.out_dir / "soak_memory.csv") if self.out_dir else None

    def sample(self, phase: str) -> Sample:
        assert self.server.popen is not None
        procs = list_procs()
        raylet = find_raylet(procs, self.server.popen.pid)
        members = cluster_members(procs, raylet) if raylet is not None else set()
        members.add(self.server.popen.pid)
        mine = {pid: procs[pid] for pid in members if pid in procs}
        kinds = {
            pid: ("driver" if pid == self.server.popen.pid else process_kind(p.title))
            for pid, p in mine.items()
        }
        store = store_use(procs[raylet].title) if raylet is not None else None
        entries = cache_entries(self.server.base_url)
        s = Sample(time.monotonic() - self.t0, phase, sample_procs(mine, kinds), store, entries)
        memory_rows = [
            {"phase": phase} | breakdown_row(s.t_s, kind, pid, b)
            for pid, kind in kinds.items()
            if (b := read_breakdown(pid)) is not None
        ]
        self.samples.append(s)
        if self.csv is not None and self.memory_csv is not None:
            self.csv.append([dict(zip(CSV_HEADER, row, strict=True)) for row in csv_rows(s)])
            self.memory_csv.append(memory_rows)
        rss = sum(p.rss_bytes for p in s.procs) / 2**20
        used = f"{s.store.used_bytes / 2**20:.1f} MiB / {s.store.num_objects} objects" if s.store else "?"
        log(
            f"sample t={s.t_s:.0f}s {phase}: {len(s.procs)} processes, RSS {rss:.0f} MiB, store {used}, "
            f"encoder-cache entries {entries}, load average {os.getloadavg()[0]:.0f}"
        )
        return s

    async def every(self, period_s: float, phase: Callable[[], str], stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.to_thread(self.sample, phase())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period_s)


def cache_entries(base_url: str) -> int | None:
    """Entries the encoder caches hold (``GET /stats``, summed over models): the embeddings the object
    store keeps by design, up to each cache's capacity."""
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"{base_url}/stats", timeout=30
        ) as r:
            stats = json.loads(r.read())
        return sum(int(m["encoder_cache"]["entries"]) for m in stats.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def store_use(raylet_title: str) -> StoreUse | None:
    """The object store's bytes and objects, asked of the raylet through the GCS (no driver joins):
    at the address the raylet was given, else on loopback at its port."""
    address = gcs_address(raylet_title)
    if address is None:
        return None
    if "ray" not in sys.modules:  # as cluster/bench/profiler.py: Ray on loopback, and the token that
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # `mmserve serve`'s ray.init()
        os.environ.setdefault("RAY_AUTH_MODE", "token")  # left where Ray finds it
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    port = address.rsplit(":", 1)[1]
    for addr in dict.fromkeys((f"127.0.0.1:{port}", address)):
        try:
            reply = get_memory_info_reply(get_state_from_address(addr), timeout_seconds=30.0)
        except Exception as e:  # a sample without the store is still a sample
            log(f"object store not read at {addr}: {type(e).__name__}: {str(e)[:200]}")
            continue
        st = reply.store_stats
        return StoreUse(int(st.object_store_bytes_used), int(st.num_local_objects))
    return None
