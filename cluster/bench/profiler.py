"""The app's processes for ``--profile``: which processes are the app, what kind each is, and their
CPU time at one instant (``Profiler.snapshot``); the arithmetic and tables are in ``cpu_profile``."""

from __future__ import annotations

import ipaddress
import os
import sys

from cluster.bench.cpu_profile import BENCH_CLIENT, DRIVER, PROGRAM_KINDS, ProcSample, process_kind
from cluster.bench.procs import (
    ProcInfo,
    cluster_members,
    find_raylet,
    gcs_address,
    list_procs,
    pid_listening_on,
)


class Profiler:
    """Snapshots of the CPU time of the app's processes and of the benchmark's own process."""

    def __init__(self, anchor_pid: int | None, own_kind: str = BENCH_CLIENT) -> None:
        """``anchor_pid``: a process of the app (a driver that started its Ray, or a worker such as the
        HTTP proxy); None profiles every Ray process of the machine by title."""
        self.anchor_pid = anchor_pid
        self.own_kind = own_kind
        self.actor_classes: dict[int, str] = {}
        self.notes: list[str] = []

    @classmethod
    def for_server(cls, port: int) -> Profiler:
        """The app answering on ``port`` here: found by the socket listening on it (the Serve proxy)."""
        pid = pid_listening_on(port)
        prof = cls(pid)
        if pid is None:
            prof.notes.append(
                f"no process of this machine listens on port {port}: profiling every Ray process by title"
            )
        return prof

    def connect_ray(self) -> None:
        """Learn pid -> actor class from Ray's state, connecting to the app's cluster if not connected:
        only to a GCS on a loopback address, and with Ray kept on loopback (never ``address="auto"``,
        which may pick another cluster of this machine)."""
        try:
            if "ray" not in sys.modules:
                # Ray otherwise swaps 127.0.0.1 for the machine's routable address (read at import).
                os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
                # A local cluster started by ray.init() (``mmserve serve``) has token auth on by default;
                # Ray then finds the token where that ray.init() left it.
                os.environ.setdefault("RAY_AUTH_MODE", "token")
            import ray

            if not ray.is_initialized():
                address = self._gcs_address()
                refusal = loopback_refusal(address, os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"))
                if refusal:
                    self.notes.append(f"not connecting to Ray: {refusal}; kinds come from process titles")
                    return
                ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            self.actor_classes = actor_classes()
        except Exception as e:  # the profile still works from process titles
            self.notes.append(
                f"could not read Ray's actor table ({type(e).__name__}: {e}); kinds come from process titles"
            )

    def _gcs_address(self) -> str | None:
        procs = list_procs()
        raylet = find_raylet(procs, self.anchor_pid) if self.anchor_pid is not None else None
        return gcs_address(procs[raylet].title) if raylet is not None else None

    def snapshot(self) -> dict[int, ProcSample]:
        procs = list_procs()
        me = os.getpid()
        pids, driver = self._app_pids(procs)
        out = {pid: self._sample(procs[pid], driver) for pid in pids if pid != me}
        if me in procs:
            out[me] = _sample(procs[me], self.own_kind)
        return out

    def _app_pids(self, procs: dict[int, ProcInfo]) -> tuple[set[int], int | None]:
        raylet = find_raylet(procs, self.anchor_pid) if self.anchor_pid is not None else None
        if raylet is None:
            return {p.pid for p in procs.values() if _is_ray_process(p.title)}, None
        return cluster_members(procs, raylet), procs[raylet].ppid

    def _sample(self, p: ProcInfo, driver: int | None) -> ProcSample:
        kind = DRIVER if p.pid == driver else process_kind(p.title, self.actor_classes.get(p.pid))
        return _sample(p, kind)


def loopback_refusal(gcs: str | None, enable_clusters_env: str | None) -> str | None:
    """Why the benchmark must not connect a Ray driver to ``gcs`` (None: it may)."""
    if gcs is None:
        return "found no raylet of the app on this machine, hence no GCS address"
    host = gcs.rsplit(":", 1)[0].strip("[]")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        return f"the app's GCS is at {gcs}, not on loopback"
    if enable_clusters_env != "0":
        return "Ray was imported before RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set: it would leave loopback"
    return None


def _sample(p: ProcInfo, kind: str) -> ProcSample:
    return ProcSample(p.pid, p.start_ticks, p.cpu_ticks, kind, p.title[:200])


def _is_ray_process(title: str) -> bool:
    kind = process_kind(title)
    return title.startswith("ray::") or kind == "raylet" or any(kind == k for _, k in PROGRAM_KINDS)


def actor_classes() -> dict[int, str]:
    """pid -> class name of every live actor of the connected cluster: Ray's state API when the
    dashboard serves it, else the GCS actor table (what a cluster started without a dashboard has)."""
    try:
        from ray.util.state import list_actors

        actors = list_actors(
            filters=[("state", "=", "ALIVE")], limit=10_000, detail=True, raise_on_missing_output=False
        )
        return {int(a.pid): a.class_name for a in actors if a.pid}
    except Exception:
        from ray._private import state

        table = state.actors()
        return {
            int(a["Pid"]): a["ActorClassName"]
            for a in table.values()
            if a.get("State") == "ALIVE" and a.get("Pid")
        }
