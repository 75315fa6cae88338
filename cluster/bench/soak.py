"""``python -m cluster.bench.soak``: a bounded soak of ``mmserve serve`` at 80 % of its measured capacity.

Starts ``mmserve serve`` (the tiny default models unless ``--serve-args`` says otherwise) on loopback
in its own session, measures its capacity with a short closed-loop ramp (or takes ``--capacity-rps``),
then sends an open-loop stream of mixed requests at ``--load-fraction`` of it for ``--minutes``: text,
new images, images repeated by ``uuid`` alone, audio, and clients that drop the connection after the
first streamed chunk. Every ``--sample-s`` it reads, for every process of the app (the driver, GCS,
raylet, Serve controller and proxy, each replica and cache shard), its resident memory and open file
descriptors from ``/proc``, and the object store's use from the raylet; then ``--quiet-s`` seconds
without load, still sampling, to see the store return to its baseline.

Writes ``soak.csv`` and ``soak_memory.csv`` (a row per process appended at each sample, so a killed run
keeps them) and ``soak.png`` under ``--out-dir`` and prints the growth of each process between
minute 5 (``--ref-s``) and the end, the fd growth and the store before and after
(``cluster/bench/soak_stats.py``). Real Ray, real HTTP, the real ``openai`` client.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from cluster.bench.client import make_client, send_request
from cluster.bench.servers import ServerProcess
from cluster.bench.soak_plot import write_figure
from cluster.bench.soak_probe import AppProbe, log
from cluster.bench.soak_stats import (
    Sample,
    growth_table,
    verdict,
)
from cluster.bench.workload import (
    RequestSpec,
    WorkloadConfig,
    audio_request,
    image_request,
    text_request,
)

REPO = Path(__file__).resolve().parents[2]
# One cycle of the mix: what share of requests is which kind (disconnect: a client leaving mid-stream).
MIX = ("text", "text", "text", "image", "image", "uuid", "uuid", "audio", "audio", "disconnect")
UUID_LAG = 4  # a uuid repeat names the image sent this many images earlier (~2 cycles: still cached)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cluster.bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8476)
    p.add_argument("--serve-args", default="", help="more `mmserve serve` flags (e.g. `--num-cpus 4`)")
    p.add_argument("--minutes", type=float, default=20.0, help="load duration")
    p.add_argument("--capacity-rps", type=float, default=None, help="skip the ramp: capacity in requests/s")
    p.add_argument(
        "--ramp",
        default="1,2,4,8,16",
        help="closed-loop concurrencies of the capacity ramp, in order; it stops once a step gains < 10 %%",
    )
    p.add_argument("--ramp-step-s", type=float, default=30.0)
    p.add_argument("--load-fraction", type=float, default=0.8)
    p.add_argument("--max-in-flight", type=int, default=32, help="arrivals past this are counted, not sent")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--sample-s", type=float, default=60.0)
    p.add_argument("--ref-s", type=float, default=300.0, help="the reference sample: minute 5 of the load")
    p.add_argument("--quiet-s", type=float, default=180.0, help="no load, still sampling, after the load")
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/mmserve-soak"))
    p.add_argument(
        "--plot", type=Path, default=None, help="also copy the PNG here (e.g. docs/bench/soak.png)"
    )
    return p.parse_args(argv)


# -- the mix ---------------------------------------------------------------------------------------------


@dataclass
class Mix:
    """An endless cycle of ``MIX`` kinds; new images and audio draw fresh seeds from a counter. A uuid
    repeat names an image sent ``UUID_LAG`` images before (by then committed, and not yet evicted
    from an encoder cache that distinct images keep cycling), as a client re-sending a recent image
    by name does; a fixed set named once at the start would be evicted within minutes, and every
    repeat after that a 400 ``mm_cache_miss`` (the first soak run's 994 of 1,286)."""

    cfg: WorkloadConfig
    n: Iterator[int] = field(default_factory=itertools.count)
    kinds: Iterator[str] = field(default_factory=lambda: itertools.cycle(MIX))
    images: list[int] = field(default_factory=list)  # the last images sent with bytes (their i)

    def next(self) -> tuple[str, RequestSpec]:
        kind, i = next(self.kinds), next(self.n)
        if kind == "text":
            return kind, text_request(self.cfg, i)
        if kind == "image" or (kind == "uuid" and len(self.images) < UUID_LAG):
            self.images = [*self.images[-(UUID_LAG - 1) :], i]
            return kind, image_request(self.cfg, "soak", i)
        if kind == "uuid":
            return kind, image_request(self.cfg, "soak", self.images[0], send_bytes=False)
        if kind == "audio":
            return kind, audio_request(self.cfg, "soak", i)
        return kind, image_request(self.cfg, "soak-leave", i)


async def send_and_leave(base_url: str, spec: RequestSpec, max_tokens: int) -> tuple[bool, str | None]:
    """A streamed request whose client closes the connection after the first chunk (a user leaving)."""
    body = {
        "model": spec.model,
        "messages": spec.messages(),
        "max_tokens": max_tokens * 4,
        "stream": True,
        "ignore_eos": True,
    }
    try:
        async with (
            httpx.AsyncClient(trust_env=False, timeout=60) as http,
            http.stream("POST", base_url + "/v1/chat/completions", json=body) as resp,
        ):
            if resp.status_code != 200:
                return False, f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    return True, None  # leave: the context manager closes the connection
    except httpx.HTTPError as e:
        return False, f"{type(e).__name__}: {e}"
    return False, "stream ended without a chunk"


@dataclass
class Tally:
    sent: Counter[str] = field(default_factory=Counter)
    ok: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    skipped: int = 0  # arrivals dropped because --max-in-flight were open

    def record(self, kind: str, ok: bool, error: str | None) -> None:
        self.sent[kind] += 1
        if ok:
            self.ok[kind] += 1
        elif error:
            self.errors[error[:120]] += 1


async def one(
    client: openai.AsyncOpenAI,
    base_url: str,
    kind: str,
    spec: RequestSpec,
    args: argparse.Namespace,
    tally: Tally,
) -> None:
    if kind == "disconnect":
        ok, err = await send_and_leave(base_url, spec, args.max_tokens)
    else:
        r = await send_request(client, spec, args.max_tokens)
        ok, err = r.ok, r.error
    tally.record(kind, ok, err)


# -- capacity and load -----------------------------------------------------------------------------------


def ramp_goes_on(rates: list[float], gain: float = 1.10) -> bool:
    """Another ramp step is worth it while the last one raised the best rate by ``gain`` or more."""
    return len(rates) < 2 or rates[-1] >= gain * max(rates[:-1])


async def closed_loop(
    client: openai.AsyncOpenAI, base: str, mix: Mix, conc: int, secs: float, args: argparse.Namespace
) -> float:
    """Completed requests per second with ``conc`` clients each sending the next request at once."""
    tally = Tally()
    end = time.monotonic() + secs

    async def worker() -> None:
        while time.monotonic() < end:
            kind, spec = mix.next()
            await one(client, base, kind, spec, args, tally)

    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(conc)))
    rate = sum(tally.ok.values()) / (time.monotonic() - t0)
    log(f"ramp c={conc}: {rate:.2f} req/s ({dict(tally.ok)} ok, {sum(tally.errors.values())} errors)")
    return rate


async def open_loop(
    client: openai.AsyncOpenAI,
    base: str,
    mix: Mix,
    rate: float,
    secs: float,
    args: argparse.Namespace,
    tally: Tally,
) -> None:
    """Poisson arrivals at ``rate``/s for ``secs``; at most ``--max-in-flight`` open."""
    rng = random.Random(0)
    open_tasks: set[asyncio.Task[None]] = set()
    end = time.monotonic() + secs
    next_at = time.monotonic()
    while next_at < end:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        next_at += rng.expovariate(rate)
        kind, spec = mix.next()
        if len(open_tasks) >= args.max_in_flight:
            tally.skipped += 1
            continue
        task = asyncio.create_task(one(client, base, kind, spec, args, tally))
        open_tasks.add(task)
        task.add_done_callback(open_tasks.discard)
    if open_tasks:
        await asyncio.gather(*open_tasks)


# -- the run -------------------------------------------------------------------------------------------


def mmserve(args: argparse.Namespace) -> ServerProcess:
    argv = [sys.executable, "-m", "cluster.cli", "serve", "--host", "127.0.0.1", "--port", str(args.port)]
    argv += args.serve_args.split()
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray's own sockets on loopback too (serve_cli.py)
    return ServerProcess("mmserve", argv, args.port, args.out_dir / "serve.log", env=env, cwd=REPO)


async def drive(args: argparse.Namespace, server: ServerProcess, probe: AppProbe) -> tuple[float, Tally]:
    base = server.base_url
    client = make_client(base + "/v1", args.timeout_s)
    mix = Mix(WorkloadConfig(run_id=os.getpid()))
    if args.capacity_rps is None:
        rates: list[float] = []
        for c in args.ramp.split(","):
            rates.append(await closed_loop(client, base, mix, int(c), args.ramp_step_s, args))
            if not ramp_goes_on(rates):
                break
        capacity = max(rates)
    else:
        capacity = args.capacity_rps
    rate = args.load_fraction * capacity
    log(f"capacity {capacity:.2f} req/s; soak at {rate:.2f} req/s for {args.minutes:g} min")
    await asyncio.to_thread(probe.sample, "baseline")
    phase = {"now": "load"}
    stop = asyncio.Event()
    load_t0 = probe.samples[-1].t_s
    probe_task = asyncio.create_task(probe.every(args.sample_s, lambda: phase["now"], stop))
    tally = Tally()
    await open_loop(client, base, mix, rate, args.minutes * 60, args, tally)
    phase["now"] = "quiet"
    log(f"load done: sent {dict(tally.sent)}, ok {dict(tally.ok)}, skipped {tally.skipped}")
    await asyncio.sleep(args.quiet_s)
    stop.set()
    await probe_task
    await asyncio.to_thread(probe.sample, "quiet")
    await client.close()
    return load_t0, tally


def report(args: argparse.Namespace, probe: AppProbe, load_t0: float, tally: Tally) -> str:
    ref_s = load_t0 + args.ref_s
    v = verdict(probe.samples, ref_s)
    mib = 2**20
    lines = [
        f"## mmserve soak: {args.minutes:g} min at {args.load_fraction:.0%} of capacity",
        "",
        f"requests sent {sum(tally.sent.values())} ({dict(tally.sent)}), ok {sum(tally.ok.values())}, "
        f"arrivals skipped (in flight at the cap) {tally.skipped}",
        f"errors: {dict(tally.errors.most_common(8)) or 'none'}",
        "",
        growth_table(probe.samples, ref_s),
        "",
        f"worst RSS growth (minute {args.ref_s / 60:.3g} → end): {100 * v.worst_rss_growth:+.2f} % "
        f"({v.worst_rss_kind}) {'OK' if v.rss_ok else 'OVER 5 %'}",
        f"worst growth of RSS less the object store's pages: {100 * v.worst_private_growth:+.2f} % "
        f"({v.worst_private_kind}) {'OK' if v.private_ok else 'OVER 5 %'}",
        f"open fds, summed, minute {args.ref_s / 60:.3g} → end: {v.fd_growth:+d} {'OK' if v.fds_ok else 'GREW'}",
        "object store: baseline "
        + (f"{v.store_baseline / mib:.2f} MiB" if v.store_baseline is not None else "?")
        + ", after the quiet period "
        + (f"{v.store_after / mib:.2f} MiB" if v.store_after is not None else "?")
        + (" OK" if v.store_ok else " NOT BACK"),
        "encoder-cache entries (embeddings the store keeps by design, up to each cache's capacity): "
        f"baseline {_entries(probe.samples, 'baseline')}, after the quiet period {_entries(probe.samples, 'quiet')}",
    ]
    return "\n".join(lines)


def _entries(samples: list[Sample], phase: str) -> str:
    got = [s.cache_entries for s in samples if s.phase == phase and s.cache_entries is not None]
    return str(got[-1]) if got else "?"


async def run(args: argparse.Namespace) -> str:
    server = mmserve(args)
    log(f"starting: {server.describe()} (log {server.log_path})")
    server.start()
    try:
        log(f"healthy after {server.wait_healthy(600):.0f} s")
        probe = AppProbe(server, out_dir=args.out_dir)  # soak.csv, soak_memory.csv: a row per sample
        load_t0, tally = await drive(args, server, probe)
    finally:
        server.stop()
    write_figure(probe.samples, args.out_dir / "soak.png", load_t0, args.ref_s)
    if args.plot is not None:
        write_figure(probe.samples, args.plot, load_t0, args.ref_s)
    text = report(args, probe, load_t0, tally)
    (args.out_dir / "soak.md").write_text(text + "\n")
    return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    print(asyncio.run(run(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
