"""A server under benchmark as a process tree of this machine: start it in its own session, wait until
it answers ``GET /health``, read the CPU time of all its processes, and stop it (by pid only)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from cluster.bench_procs import ProcInfo, descendants, list_procs, pid_listening_on
from cluster.bench_profile import DRIVER, ProcSample, process_kind


@dataclass
class ServerProcess:
    """One server started by us: ``setsid`` makes it the leader of its own process group."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    root_kind: str = DRIVER  # what the started process itself is called in the profile
    popen: subprocess.Popen[bytes] | None = None
    seen: dict[int, int] = field(default_factory=dict)  # pid -> start ticks of every process of its tree

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        holder = pid_listening_on(self.port)
        if holder is not None:
            raise RuntimeError(
                f"{self.name}: port {self.port} is already taken by pid {holder}; pick another"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                cwd=self.cwd,
                start_new_session=True,
                preexec_fn=_default_sigint,
            )

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds from now until ``GET /health`` answers 200; raises (with the log's tail) if it dies."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.popen is not None and self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited ({self.popen.returncode}) while starting:\n{self.log_tail()}"
                )
            if http_status(self.base_url + "/health") == 200:
                return time.monotonic() - t0
            self.snapshot()  # learn the pids while it starts, so stop() finds them all
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def tree(self) -> dict[int, ProcInfo]:
        if self.popen is None:
            return {}
        procs = list_procs()
        pids = descendants(procs, self.popen.pid) | {self.popen.pid}
        tree = {pid: procs[pid] for pid in pids if pid in procs}
        self.seen.update({pid: p.start_ticks for pid, p in tree.items()})
        return tree

    def snapshot(self) -> dict[int, ProcSample]:
        """CPU time of every process of the server's tree, by kind (the started process as ``root_kind``)."""
        root = self.popen.pid if self.popen else -1
        return {
            pid: ProcSample(
                pid,
                p.start_ticks,
                p.cpu_ticks,
                self.root_kind if pid == root else process_kind(p.title),
                p.title[:200],
            )
            for pid, p in self.tree().items()
        }

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGINT to the server (``mmserve serve`` shuts its Ray down on Ctrl-C; vLLM exits on it too), then
        SIGTERM, then SIGKILL to whatever of the processes it ever had is still alive, by pid."""
        if self.popen is None:
            return
        self.tree()
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0)):
            if self.popen.poll() is None:
                self.popen.send_signal(sig)
                try:
                    self.popen.wait(wait_s)
                except subprocess.TimeoutExpired:
                    continue
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)
        time.sleep(2.0)
        for pid in self.leftovers():
            os.kill(pid, signal.SIGKILL)

    def leftovers(self) -> list[int]:
        """The pids of our tree still alive (same start time: not a later process reusing the pid)."""
        alive = list_procs(self.seen)
        return [pid for pid, p in alive.items() if p.start_ticks == self.seen[pid]]


def _default_sigint() -> None:
    """In the child before exec: a runner started in the background (``cmd &``) has SIGINT ignored, and
    the server would inherit that and never see the Ctrl-C that shuts it down cleanly."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def http_status(url: str, timeout_s: float = 5.0) -> int | None:
    """The HTTP status of ``GET url`` through no proxy, or None when nothing answers."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, OSError):
        return None
