"""A server under benchmark as a process tree of this machine: start it in its own session, wait until
it answers ``GET /health``, read the CPU time of all its processes, and stop it (by pid only).

``ServerProcess`` is one command (``vllm serve``, ``mmserve serve``); ``ClusterServer`` is the cluster
deployment, ``ray start`` (one node or more) and ``serve deploy`` of a shipped config
(``cluster.bench.local_cluster``). Both are a ``BenchServer``.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from cluster.bench.cpu_profile import DRIVER, ProcSample, process_kind
from cluster.bench.local_cluster import LocalRayCluster, deploy_config
from cluster.bench.procs import ProcInfo, descendants, list_procs, pid_listening_on


class BenchServer(Protocol):
    """What the benchmark drives: a server on 127.0.0.1:``port`` made of processes of this machine."""

    name: str
    port: int

    @property
    def base_url(self) -> str: ...

    def describe(self) -> str: ...

    def start(self) -> None: ...

    def wait_healthy(self, timeout_s: float) -> float: ...

    def snapshot(self) -> dict[int, ProcSample]: ...

    def stop(self) -> None: ...

    def leftovers(self) -> list[int]: ...


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

    def describe(self) -> str:
        return " ".join(self.argv)

    def start(self) -> None:
        _check_port_free(self.name, self.port)
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


@dataclass(frozen=True)
class RayNode:
    """One ``ray start`` of a cluster deployment: its logical CPUs and custom resources."""

    num_cpus: int
    resources: Mapping[str, float] = field(default_factory=dict)

    def flags(self) -> str:
        res = f" --resources='{json.dumps(dict(self.resources))}'" if self.resources else ""
        return f"--num-cpus={self.num_cpus}{res}"


@dataclass
class ClusterServer:
    """The cluster deployment as the README tells a user to start it: ``ray start --head`` (and one
    ``ray start --address`` per further node, on this machine), then ``serve deploy`` of ``shipped``
    with only the model's path and name, Serve's HTTP port and, where the file sets none, each pool's
    node markers (``markers``: pool -> resources) rewritten. Every process of the cluster counts."""

    name: str
    shipped: Path
    port: int
    model_dir: Path
    served_name: str
    out_dir: Path
    nodes: Sequence[RayNode]
    markers: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    root: Path = Path(".")  # the checkout the cluster imports `cluster.app` from
    env: Mapping[str, str] = field(default_factory=dict)  # beyond the README's, for every ray/serve command
    cluster: LocalRayCluster | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.out_dir / f"{self.name}.yaml"

    def describe(self) -> str:
        head, *others = self.nodes
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        steps = [f"{env + ' ' if env else ''}ray start --head {head.flags()}"]
        steps += [f"ray start --address=HEAD {node.flags()}" for node in others]
        steps.append(f"serve deploy {self.config_path} (= {self.shipped}, model path/name, port, markers)")
        return "; ".join(steps)

    def start(self) -> None:
        _check_port_free(self.name, self.port)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        deploy_config(
            self.shipped,
            self.config_path,
            self.port,
            model_path=str(self.model_dir),
            model_name=self.served_name,
            resources=self.markers,
        )
        self.cluster = LocalRayCluster(pythonpath=self.root, extra_env=self.env)
        print(
            f"{self.name}: HOME, Ray temp dir and logs under {self.cluster.root}", file=sys.stderr, flush=True
        )
        head, *others = self.nodes
        self.cluster.start_head(head.num_cpus, head.resources, multi_node=bool(others))
        for node in others:
            self.cluster.add_node(node.num_cpus, node.resources)
        self.cluster.deploy(self.config_path)

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until ``serve status`` shows the app RUNNING and ``GET /health`` answers 200."""
        assert self.cluster is not None, "start() first"
        t0 = time.monotonic()
        self.cluster.wait_running("mmserve", timeout_s)
        while http_status(self.base_url + "/health") != 200:
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(
                    f"{self.name}: RUNNING but /health is not 200; logs: {self.cluster.logs()}"
                )
            time.sleep(0.5)
        return time.monotonic() - t0

    def snapshot(self) -> dict[int, ProcSample]:
        procs = self.cluster.members() if self.cluster else {}
        return {
            pid: ProcSample(pid, p.start_ticks, p.cpu_ticks, process_kind(p.title), p.title[:200])
            for pid, p in procs.items()
        }

    def stop(self) -> None:
        """The cluster's processes, by pid (``ray stop`` would stop every Ray of the machine); its temp
        dir and logs stay under ``self.cluster.root``."""
        if self.cluster is not None:
            self.cluster.stop()

    def leftovers(self) -> list[int]:
        return self.cluster.leftovers() if self.cluster else []


def _check_port_free(name: str, port: int) -> None:
    holder = pid_listening_on(port)
    if holder is not None:
        raise RuntimeError(f"{name}: port {port} is already taken by pid {holder}; pick another")


def _default_sigint() -> None:
    """In the child before exec: a runner started in the background (``cmd &``) has SIGINT ignored, and
    the server would inherit that and never see the Ctrl-C that shuts it down cleanly."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _direct() -> urllib.request.OpenerDirector:
    """An opener that goes through no proxy, whatever the environment says (loopback servers)."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_status(url: str, timeout_s: float = 5.0) -> int | None:
    """The HTTP status of ``GET url`` through no proxy, or None when nothing answers."""
    try:
        with _direct().open(url, timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, OSError):
        return None


def pool_stats(base_url: str) -> dict[str, object]:
    """The server's ``GET /stats?pools=true`` (mmserve's, on loopback), or {} where there is none
    (vLLM) or it does not answer in 10 s."""
    try:
        with _direct().open(f"{base_url}/stats?pools=true", timeout=10) as r:
            got = json.loads(r.read())
    except (OSError, ValueError, http.client.HTTPException):
        return {}
    return got if isinstance(got, dict) else {}
