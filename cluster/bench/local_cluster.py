"""A Ray cluster on this machine, started the way the README tells a cluster user to: ``ray start``
(a head, and optionally more nodes with ``ray start --address``), then ``serve deploy`` of a shipped
config, each a subprocess of the ``ray`` / ``serve`` command lines of this Python.

The README's environment (section "Running on a Ray cluster and on Kubernetes"): Serve's settings of
``cluster/serve_env.py`` where ``ray start`` runs, ``RAY_AUTH_MODE=token`` for every ``ray`` and
``serve`` command (Ray 2.60 turns token authentication on at ``ray start --head`` when a token exists,
and the ``serve`` CLI sends it only in that mode), and a token made once by
``ray get-auth-token --generate``. What this module adds for a machine shared with other clusters:
its own ``HOME`` (so the token and the tiny models are this cluster's, as on a fresh machine), its
own ``--temp-dir``, free ports for everything Ray would otherwise put on a fixed default, nodes on
loopback addresses (see ``start_head``), and a stop of exactly this cluster's
processes by pid (``ray stop`` would stop every Ray of the machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from cluster.bench.json_body import JSON, json_object
from cluster.bench.procs import ProcInfo, descendants, is_raylet, list_procs
from cluster.serve_env import SERVE_ENV_DEFAULTS

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# The README's environment for `ray start` and every `serve` command.
README_ENV: dict[str, str] = {"RAY_AUTH_MODE": "token", **SERVE_ENV_DEFAULTS}
# Above Ray's worker ports (10002-19999); the kernel's ephemeral range is left out as well.
_PORTS = range(20000, 32768)


def free_port(taken: set[int] | None = None) -> int:
    """A loopback port nothing listens on, in 20000-32767 outside the kernel's ephemeral range (the
    ports Ray's own processes draw from while they start), not in ``taken``."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999
    ports = [p for p in _PORTS if not lo <= p <= hi and p not in (taken or set())]
    for port in random.sample(ports, min(len(ports), 256)):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {_PORTS}")


def deploy_config(
    shipped: Path,
    out: Path,
    http_port: int,
    model_path: str | None = None,
    model_name: str | None = None,
    resources: Mapping[str, Mapping[str, float]] | None = None,
) -> dict[str, object]:
    """``shipped`` with only what this machine needs rewritten, written to ``out``: Serve's HTTP port,
    and optionally the first model's checkpoint (``path`` instead of ``tiny``), its served name, and
    node markers per pool (``{"encoder": {"encoder_node": 0.001}}``) where the file sets none (see
    ``place_markers``)."""
    config = yaml.safe_load(shipped.read_text())
    config["http_options"]["port"] = http_port
    args = config["applications"][0]["args"]
    if "port" in args:
        args["port"] = http_port
    model = args["models"][0]
    if model_path is not None:
        model.pop("tiny", None)
        model["path"] = model_path
    if model_name is not None:
        model["name"] = model_name
    place_markers(model, resources or {})
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return dict(config)


def place_markers(model: dict[str, Any], resources: Mapping[str, Mapping[str, float]]) -> None:
    """Node markers on each Serve deployment of a model config's pools, where the deployment sets no
    ``resources`` of its own. Keys: ``encoder``, ``llm``, ``prefill``, ``decode``. An E/P/D model
    (``llm.pools``) has no deployment of ``llm.deployment`` (its pools have their own): ``llm``'s
    markers go to every pool there, a role's own markers (``prefill``, ``decode``) before them."""
    llm = model.get("llm") or {}
    pools = {p["role"]: p for p in llm.get("pools") or []}
    for name, markers in resources.items():
        if name in ("prefill", "decode"):
            if name not in pools:
                raise KeyError(f"markers for the {name} pool, but the config's llm.pools has none")
            _put_markers(pools[name], markers)
        elif not (name == "llm" and pools):
            _put_markers(model[name], markers)
    if pools and "llm" in resources:
        for p in pools.values():
            _put_markers(p, resources["llm"])


def _put_markers(section: dict[str, Any], markers: Mapping[str, float]) -> None:
    section.setdefault("deployment", {}).setdefault("resources", dict(markers))


class LocalRayCluster:
    """One Ray cluster of ``ray start`` processes on this machine; ``stop()`` ends exactly those."""

    def __init__(
        self, root: Path | None = None, pythonpath: Path = REPO, extra_env: Mapping[str, str] | None = None
    ) -> None:
        # Short: Ray's Unix sockets live under the temp dir, and a socket path has at most 107 bytes.
        self.root = root or Path(tempfile.mkdtemp(prefix="mmray-", dir="/tmp"))
        self.home = self.root / "home"
        self.temp_dir = self.root / "ray"
        self.home.mkdir(parents=True, exist_ok=True)
        self.pythonpath = pythonpath
        self.extra_env = dict(extra_env or {})  # on top of the README's (e.g. RAY_SERVE_ENABLE_HA_PROXY=1)
        self.ports: set[int] = set()
        self.gcs_port = self._port()
        self.dashboard_port = self._port()
        self.head_ip = "127.0.0.1"
        self.multi_node = False
        self.seen: dict[int, int] = {}  # pid -> start ticks of every process of the cluster seen

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def env(self) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(self.pythonpath), os.environ.get("PYTHONPATH", "")) if p)
        return {
            **os.environ,
            **README_ENV,
            "HOME": str(self.home),
            "PYTHONPATH": path,
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1" if self.multi_node else "0",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            **self.extra_env,
        }

    def run(
        self, tool: str, *args: str, timeout_s: float = 300.0, env: Mapping[str, str] | None = None
    ) -> str:
        """``ray ARGS`` or ``serve ARGS`` in the README's environment; its stdout, or raises with its output."""
        argv = [str(BIN / tool), *args]
        done = subprocess.run(
            argv,
            env={**self.env(), **(env or {})},
            cwd=self.pythonpath,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
            raise RuntimeError(f"`{tool} {' '.join(args)}` exited {done.returncode}:\n{tail}")
        return done.stdout

    def start_head(
        self, num_cpus: int, resources: Mapping[str, float] | None = None, multi_node: bool = False
    ) -> None:
        """``ray get-auth-token --generate`` (a no-op once a token exists), then ``ray start --head``.

        Where the nodes live: Ray binds its GCS and raylets to the node's IP, which ``ray start`` takes
        to be the machine's routable address. One node: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes it
        127.0.0.1. ``multi_node``: ``ray start --address`` refuses to run under that setting, and with
        it on rewrites 127.0.0.1 (``localhost``, ``::1``) to the routable address, so the head takes
        ``--node-ip-address=127.0.0.2`` (loopback too, and left alone: Ray's ``is_localhost`` knows
        only those three), and a node joining it reaches it over loopback and takes 127.0.0.1."""
        if multi_node:
            self.multi_node, self.head_ip = True, "127.0.0.2"
        self.run("ray", "get-auth-token", "--generate")
        for attempt in range(1, _HEAD_TRIES + 1):
            try:
                self.run(
                    "ray",
                    "start",
                    "--head",
                    *([f"--node-ip-address={self.head_ip}"] if multi_node else []),
                    f"--num-cpus={num_cpus}",
                    *self._resources(resources),
                    f"--temp-dir={self.temp_dir}",
                    f"--port={self.gcs_port}",
                    f"--dashboard-port={self.dashboard_port}",
                    f"--ray-client-server-port={self._port()}",
                    *self._node_ports(),
                )
                return
            except RuntimeError as e:
                # A busy machine can miss Ray's fixed start-up waits (the GCS's node info, the raylet's
                # registration): stop what this try started and start again on fresh ports.
                if not any(m in str(e) for m in _SLOW_START) or attempt == _HEAD_TRIES:
                    raise
                self.stop()
                self.gcs_port, self.dashboard_port = self._port(), self._port()

    def add_node(self, num_cpus: int, resources: Mapping[str, float] | None = None) -> None:
        """``ray start --address=HEAD`` on this machine: another raylet and object store (the head was
        started with ``multi_node``)."""
        assert self.multi_node, "start_head(..., multi_node=True) first"
        self.run(
            "ray",
            "start",
            f"--address={self.address}",
            f"--num-cpus={num_cpus}",
            *self._resources(resources),
            *self._node_ports(),
        )

    def deploy(self, config: Path) -> None:
        self.run("serve", "deploy", str(config), "-a", self.dashboard_url)

    def serve_status(self) -> JSON:
        out = yaml.safe_load(self.run("serve", "status", "-a", self.dashboard_url, timeout_s=120))
        return out if isinstance(out, dict) else {}

    def wait_running(self, app: str, timeout_s: float, poll_s: float = 2.0) -> float:
        """Seconds until ``serve status`` shows ``app`` RUNNING; raises on DEPLOY_FAILED or timeout."""
        t0 = time.monotonic()
        status: JSON = {}
        while time.monotonic() - t0 < timeout_s:
            status = self.serve_status()
            state = json_object(json_object(status.get("applications") or {}).get(app, {})).get("status")
            if state == "RUNNING":
                return time.monotonic() - t0
            if state == "DEPLOY_FAILED":
                raise RuntimeError(f"{app} failed to deploy:\n{yaml.safe_dump(status)}")
            self.members()  # learn the pids while it starts, so stop() finds them all
            time.sleep(poll_s)
        raise RuntimeError(f"{app} not RUNNING after {timeout_s:.0f} s:\n{yaml.safe_dump(status)}")

    def shutdown_serve(self) -> None:
        self.run("serve", "shutdown", "-y", "-a", self.dashboard_url)

    def members(self) -> dict[int, ProcInfo]:
        """This cluster's processes now: those whose command line names its temp dir (GCS, raylets,
        dashboard, monitors, agents) and their descendants (workers: Serve's replicas and actors)."""
        procs = list_procs()
        tag = str(self.temp_dir)
        pids = {pid for pid, p in procs.items() if tag in p.title}
        for pid in list(pids):
            pids |= descendants(procs, pid)
        mine = {pid: procs[pid] for pid in pids}
        self.seen.update({pid: p.start_ticks for pid, p in mine.items()})
        return mine

    def leftovers(self) -> list[int]:
        """The pids of this cluster's processes still alive (not a later process reusing a pid)."""
        self.members()
        alive = list_procs(self.seen)
        return [pid for pid, p in alive.items() if p.start_ticks == self.seen[pid]]

    def stop(self, grace_s: float = 20.0) -> list[int]:
        """What ``ray stop`` does, for this cluster only: SIGTERM to the raylets (their workers share
        their fate), then to the rest, SIGKILL to what is left after ``grace_s``. Returns the pids
        that needed SIGKILL."""
        procs = self.members()
        raylets = [pid for pid, p in procs.items() if is_raylet(p.title)]
        for group in (raylets, [pid for pid in procs if pid not in raylets]):
            for pid in group:
                _signal(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s / 2
            while time.monotonic() < deadline and any(pid in self.leftovers() for pid in group):
                time.sleep(0.2)
        killed = self.leftovers()
        for pid in killed:
            _signal(pid, signal.SIGKILL)
        return killed

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def logs(self) -> Path:
        return self.temp_dir / "session_latest" / "logs"

    def _port(self) -> int:
        port = free_port(self.ports)
        self.ports.add(port)
        return port

    def _node_ports(self) -> list[str]:
        # The dashboard agent's HTTP port defaults to a fixed 52365: two nodes (or clusters) would clash.
        return [f"--dashboard-agent-listen-port={self._port()}", "--disable-usage-stats"]

    @staticmethod
    def _resources(resources: Mapping[str, float] | None) -> list[str]:
        return [f"--resources={json.dumps(dict(resources))}"] if resources else []


_HEAD_TRIES = 3
_SLOW_START = ("Deadline Exceeded", "timed out")  # what `ray start --head` says when it was slow, not wrong


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
