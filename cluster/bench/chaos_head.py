"""``python -m cluster.bench.chaos_head``: the head's GCS killed and restarted under load, GCS fault tolerance on.

The README's way (section "GCS fault tolerance"): a local ``redis-server``, ``RAY_REDIS_ADDRESS`` set
where ``ray start --head`` runs (Ray's documented switch for ``ray start``; the GCS keeps its tables
in Redis), a second node with ``ray start --address`` that hosts the encoder and LLM replicas
(``encoder_node``, ``llm_node``), and the shipped ``cluster/deploy/serve-cpu.yaml`` deployed with
``serve deploy`` (``cluster/bench/local_cluster.py``)::

  head    127.0.0.2   GCS (Redis-backed), raylet, Serve controller, IngressServer (HTTP direct)
  worker  127.0.0.1   raylet, EncoderServer, LLMServer

Under ``--requests`` streamed image requests at ``--concurrency``, once ``--kill-after`` of them are
sent, the head's ``gcs_server`` is SIGKILLed and, ``--down-s`` later, started again with the same
command line and environment (what a supervisor or KubeRay's head restart does). A probe sends a
short text request every ``--probe-every-s`` meanwhile. Printed: the load's ok / coded / uncoded /
lost, the probes that failed and the seconds from the kill until new requests were answered again,
the seconds from the restart until ``serve status`` shows the app RUNNING, and the encoder cache's
reservations after the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from cluster.bench.chaos_load import Load, image_specs, wait_until
from cluster.bench.chaos_outcomes import HEADERS, ScenarioReport, report, row
from cluster.bench.local_cluster import REPO, LocalRayCluster, deploy_config, free_port
from cluster.bench.stats import markdown_table

SHIPPED = REPO / "cluster/deploy/serve-cpu.yaml"
VL = "tiny-qwen2-vl"
MARKERS = {"encoder": {"encoder_node": 0.001}, "llm": {"llm_node": 0.001}}


@dataclass
class Redis:
    """A ``redis-server`` on a loopback port, no persistence: the GCS's external storage."""

    port: int
    proc: subprocess.Popen[bytes]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextlib.contextmanager
def local_redis(workdir: Path) -> Iterator[Redis]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(
            "redis-server not found: apt-get install -y redis-server (the README's GCS FT section)"
        )
    port = free_port()
    log = open(workdir / "redis.log", "wb")  # noqa: SIM115 (closed below)
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(argv, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        if wait_until(lambda: _redis_ping(port), 30, 0.2) is None:
            raise RuntimeError(f"redis-server did not answer on {port}: {workdir / 'redis.log'}")
        yield Redis(port, proc)
    finally:
        proc.kill()
        proc.wait()
        log.close()


def _redis_ping(port: int) -> bool:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")


@dataclass
class GcsProcess:
    """The head's ``gcs_server`` as it was started: enough to start it again the same way."""

    pid: int
    argv: list[str]
    env: dict[str, str]
    cwd: str


def find_gcs(cluster: LocalRayCluster) -> GcsProcess:
    for pid, p in cluster.members().items():
        if p.title.split(" ", 1)[0].endswith("gcs_server"):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
            raw = Path(f"/proc/{pid}/environ").read_bytes().rstrip(b"\0").split(b"\0")
            env = dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)
            return GcsProcess(pid, [a.decode() for a in argv], env, os.readlink(f"/proc/{pid}/cwd"))
    raise RuntimeError("no gcs_server process in the cluster")


def restart_gcs(gcs: GcsProcess, logs: Path) -> int:
    """Start ``gcs_server`` again with its first command line and environment; returns its pid."""
    out = open(logs / "gcs_server.restarted.out", "ab")  # noqa: SIM115 (the child keeps it)
    proc = subprocess.Popen(
        gcs.argv,
        env=gcs.env,
        cwd=gcs.cwd,
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    return proc.pid


@dataclass
class Probes:
    """A short text request every ``every_s``: when new requests were answered, and when not."""

    base_url: str
    every_s: float = 0.5
    timeout_s: float = 20.0
    results: list[tuple[float, float, bool]] = field(default_factory=list)  # (sent, ended, ok)
    stop: bool = False

    async def run(self) -> None:
        body = {"model": VL, "max_tokens": 2, "messages": [{"role": "user", "content": "Ping?"}]}
        async with httpx.AsyncClient(base_url=self.base_url, trust_env=False, timeout=self.timeout_s) as http:

            async def one() -> None:
                t0 = time.monotonic()
                try:
                    ok = (await http.post("/chat/completions", json=body)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.results.append((t0, time.monotonic(), ok))

            tasks = []
            while not self.stop:
                tasks.append(asyncio.create_task(one()))
                await asyncio.sleep(self.every_s)
            await asyncio.gather(*tasks)

    def unavailable_s(self, since: float) -> tuple[int, float]:
        """(failed probes sent after ``since``, seconds from ``since`` to the answer of the first probe
        that succeeded after the last failed one: how long new requests went unanswered)."""
        after = sorted(r for r in self.results if r[0] >= since)
        failed = [r for r in after if not r[2]]
        if not failed:
            return 0, 0.0
        last_failed = failed[-1][0]
        recovered = min((r[1] for r in after if r[2] and r[0] > last_failed), default=float("nan"))
        return len(failed), recovered - since


@dataclass(frozen=True)
class HeadResult:
    report: ScenarioReport  # the load's counts; full_capacity_s: kill -> new requests answered again
    gcs_down_s: float
    probes_failed: int
    probes_sent: int
    running_after_restart_s: float | None
    text: str


async def scenario(cluster: LocalRayCluster, base_url: str, args: argparse.Namespace) -> HeadResult:
    specs = image_specs(VL, args.requests, 1, 224, seed=77)
    load = Load(base_url, specs, args.concurrency, args.deadline_s, args.max_tokens)
    probes = Probes(base_url, args.probe_every_s)
    load_task, probe_task = asyncio.create_task(load.run()), asyncio.create_task(probes.run())
    await load.wait_started(args.kill_after)
    gcs = await asyncio.to_thread(find_gcs, cluster)
    kill_at = time.monotonic()
    os.kill(gcs.pid, signal.SIGKILL)
    log(f"gcs_server {gcs.pid} SIGKILLed; restarting it in {args.down_s:.0f} s")
    await asyncio.sleep(args.down_s)
    new_pid = await asyncio.to_thread(restart_gcs, gcs, cluster.logs())
    restart_at = time.monotonic()
    log(f"gcs_server started again: pid {new_pid}")
    running_s = await asyncio.to_thread(
        wait_until, lambda: _app_running(cluster), args.recover_timeout_s, 2.0
    )
    outcomes = await load_task
    await asyncio.sleep(5)  # a few probes after the load
    probes.stop = True
    await probe_task
    failed, unavailable = probes.unavailable_s(kill_at)
    reserved = await asyncio.to_thread(_reserved, base_url)
    r = report("head-restart", outcomes, kill_at, unavailable, {"reserved": reserved})
    sent = sum(1 for p in probes.results if p[0] >= kill_at)
    lines = [
        markdown_table(HEADERS, [row(r)]),
        f"- GCS down {restart_at - kill_at:.1f} s (SIGKILL -> started again)",
        f"- new requests: {failed} of {sent} probes sent after the kill failed; "
        f"answered again {unavailable:.1f} s after the kill (the row's 'full capacity after')",
        f"- app RUNNING in `serve status` {_fmt(running_s)} s after the restart",
        *(f"- {n}" for n in r.notes),
    ]
    return HeadResult(r, restart_at - kill_at, failed, sent, running_s, "\n".join(lines))


def _fmt(x: float | None) -> str:
    return "never" if x is None else f"{x:.1f}"


def _app_running(cluster: LocalRayCluster) -> bool:
    apps = cluster.serve_status().get("applications") or {}
    app = apps.get("mmserve") if isinstance(apps, dict) else None
    return isinstance(app, dict) and app.get("status") == "RUNNING"


def _reserved(base_url: str) -> int:
    stats = httpx.get(base_url.removesuffix("/v1") + "/stats", timeout=30, trust_env=False).json()
    return int(stats[VL]["encoder_cache"]["reserved"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m cluster.bench.chaos_head", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--deadline-s", type=float, default=240.0)
    p.add_argument("--kill-after", type=int, default=16, help="requests sent before the GCS is killed")
    p.add_argument("--down-s", type=float, default=10.0, help="seconds the GCS stays dead")
    p.add_argument("--probe-every-s", type=float, default=0.5)
    p.add_argument("--recover-timeout-s", type=float, default=300.0)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> HeadResult:
    with contextlib.ExitStack() as stack:
        cluster = LocalRayCluster()
        stack.callback(cluster.remove)
        with local_redis(cluster.root) as redis:
            cluster.extra_env.update(
                {"RAY_REDIS_ADDRESS": redis.address, "RAY_external_storage_namespace": "mmserve-chaos"}
            )
            try:
                port = free_port()
                config = cluster.root / "serve-cpu.yaml"
                deploy_config(SHIPPED, config, http_port=port, resources=MARKERS)
                log(f"ray start --head (Redis {redis.address}) and a worker node; serve deploy ...")
                cluster.start_head(num_cpus=2, multi_node=True)
                cluster.add_node(num_cpus=2, resources={"encoder_node": 1, "llm_node": 1})
                cluster.deploy(config)
                cluster.wait_running("mmserve", timeout_s=args.recover_timeout_s * 2)
                return asyncio.run(scenario(cluster, f"http://127.0.0.1:{port}/v1", args))
            finally:
                cluster.stop()
    raise AssertionError("unreachable")


def log(msg: str) -> None:
    print(f"[chaos-head {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    result = run(parse_args(argv))
    print(result.text, flush=True)
    r = result.report
    return 1 if r.counts["uncoded"] or r.counts["lost"] or r.leak_count else 0


if __name__ == "__main__":
    sys.exit(main())
