"""``python -m cluster.bench.chaos``: kill one process of each kind under steady load, and burst past capacity.

Starts the app on an embedded Ray in this process (the default tiny models unless ``--config``),
drives a steady streamed load of mixed requests with the bench client (text, a repeated image,
distinct images, video, audio; ``--concurrency`` in flight), and for each ``--kill`` kind in turn:
runs ``--phase-s`` seconds, SIGKILLs the process (its PID asked from the actor itself; Serve
replicas are then replaced by Serve, a cache-index shard is restarted by Ray), runs ``--phase-s``
more, and waits for the replacement. Then ``--burst N`` sends N x the ingress capacity at once.

Prints one table row per fault (requests sent / ok / failed / lost, failures in flight at the
kill, TTFT before and after, time to the first success and until throughput is back), the burst's
figures, and what is held after the run (KV blocks, encoder-cache reservations, encoder forwards
per distinct item). Real Ray, real kills, real HTTP: nothing here is a double.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

from cluster.bench.chaos_stats import BurstReport, FaultReport, Sent, burst_report, fault_report
from cluster.bench.client import fetch_counters, make_client, send_request
from cluster.bench.stats import fmt_ms, fmt_num, markdown_table
from cluster.bench.workload import (
    RequestSpec,
    WorkloadConfig,
    audio_request,
    data_url,
    image_request,
    text_request,
)

if TYPE_CHECKING:
    import openai
    from ray.actor import ActorHandle

KINDS = ("encoder", "llm", "cache-shard", "ingress")
_DEPLOYMENT = {"encoder": "EncoderServer-{m}", "llm": "LLMServer-{m}"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cluster.bench.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="AppConfig YAML (default: the tiny default models)")
    p.add_argument("--port", type=int, default=8470)
    p.add_argument("--num-cpus", type=int, default=None)
    p.add_argument("--kill", default="encoder,llm,cache-shard", help=f"comma list of {KINDS}")
    p.add_argument(
        "--model", default="tiny-qwen2-vl", help="whose pools are killed (and the load's VL model)"
    )
    p.add_argument("--audio-model", default="tiny-qwen2-audio", help="'' for no audio in the mix")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--phase-s", type=float, default=15.0, help="load before and after each kill")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout-s", type=float, default=60.0, help="a request open longer is counted lost")
    p.add_argument(
        "--burst", type=float, default=4.0, help="burst size in multiples of the capacity; 0: none"
    )
    p.add_argument(
        "--max-concurrent", type=int, default=None, help="ingress.admission.max_concurrent_requests"
    )
    return p.parse_args(argv)


def workload(args: argparse.Namespace) -> list[RequestSpec]:
    """A cycle of mixed requests: text, one image repeated, distinct images, a video, audio."""
    cfg = WorkloadConfig(vl_model=args.model, audio_model=args.audio_model or None, run_id=os.getpid())
    from cluster.bench.media import make_video_bytes

    video = {"type": "video_url", "video_url": {"url": data_url(make_video_bytes(), "video/mp4")}}
    specs = []
    for i in range(64):
        specs.append(text_request(cfg, i))
        specs.append(image_request(cfg, "repeat", 0))  # the encoder cache serves it after the first
        specs.append(image_request(cfg, "distinct", i))
        if i % 4 == 0:
            specs.append(RequestSpec("video", args.model, [video, {"type": "text", "text": "What happens?"}]))
        if cfg.audio_model is not None and i % 2 == 0:
            specs.append(audio_request(cfg, "chaos", i))
    return specs


@dataclass
class Load:
    """Keeps ``concurrency`` requests in flight until stopped; records every one."""

    client: openai.AsyncOpenAI
    specs: list[RequestSpec]
    concurrency: int
    max_tokens: int
    records: list[Sent] = field(default_factory=list)
    media: set[int] = field(default_factory=set)  # distinct media items sent
    _stop: bool = False
    _cycle: Iterator[RequestSpec] | None = None  # set by run_until, before the workers start

    async def _worker(self) -> None:
        assert self._cycle is not None
        while not self._stop:
            spec = next(self._cycle)
            self.media.update(media_keys(spec))
            start = time.monotonic()
            r = await send_request(self.client, spec, self.max_tokens)
            self.records.append(Sent(spec.kind, start, time.monotonic(), r.ok, r.ttft_s, r.error))

    async def run_until(self, stop: asyncio.Event) -> None:
        self._cycle = itertools.cycle(self.specs)
        workers = [asyncio.create_task(self._worker()) for _ in range(self.concurrency)]
        await stop.wait()
        self._stop = True
        await asyncio.gather(*workers)


def media_keys(spec: RequestSpec) -> set[int]:
    return {hash(repr(sorted(p.items()))) for p in spec.content if p.get("type") != "text"}


def _pid_of(actor: ActorHandle) -> int:
    import ray

    return int(ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30))


def _serve_replicas(deployment: str) -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::mmserve#{deployment}#"
    return sorted(
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)
    )


def kill_one(kind: str, model: str) -> tuple[str, str]:
    """SIGKILL one process of ``kind``; returns (its actor name, the deployment or shard to watch)."""
    import ray

    if kind == "cache-shard":
        name = f"mmserve-encoder-cache-{model}-0"
        actor, watch = ray.get_actor(name, namespace="mmserve"), name
    else:
        watch = "IngressServer" if kind == "ingress" else _DEPLOYMENT[kind].format(m=model)
        names = _serve_replicas(watch)
        if kind == "ingress" and len(names) < 2:
            raise SystemExit("--kill ingress needs two or more ingress replicas (clients reach the others)")
        name = names[0]
        actor = ray.get_actor(name, namespace="serve")
    os.kill(_pid_of(actor), signal.SIGKILL)
    return name, watch


async def wait_recovered(kind: str, victim: str, watch: str, timeout_s: float = 120.0) -> float:
    """Seconds until the killed process is replaced and answering."""
    import ray
    from ray import serve

    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if kind == "cache-shard":
                actor = ray.get_actor(victim, namespace="mmserve")
                await asyncio.wait_for(actor.stats.remote(), 5)
                return time.monotonic() - start
            d = serve.status().applications["mmserve"].deployments[watch]
            if victim not in _serve_replicas(watch) and d.status == "HEALTHY":
                return time.monotonic() - start
        except Exception:  # the shard is restarting: ask again
            pass
        await asyncio.sleep(0.5)
    return float("nan")


async def run_fault(
    args: argparse.Namespace, client: openai.AsyncOpenAI, specs: list[RequestSpec], kind: str, media: set[int]
) -> FaultReport:
    load = Load(client, specs, args.concurrency, args.max_tokens, media=media)
    stop = asyncio.Event()
    task = asyncio.create_task(load.run_until(stop))
    await asyncio.sleep(args.phase_s)
    kill_at = time.monotonic()
    victim, watch = kill_one(kind, args.model)
    log(f"{kind}: killed {victim}")
    await asyncio.sleep(args.phase_s)
    back = await wait_recovered(kind, victim, watch)
    stop.set()
    await task
    log(f"{kind}: replaced after {back:.1f} s")
    return fault_report(kind, load.records, kill_at, args.phase_s)


async def run_burst(args: argparse.Namespace, base: str, capacity: int) -> BurstReport:
    spec = {"model": args.model, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    body = {**spec, "messages": [{"role": "user", "content": "Say something about the sea."}]}

    async def one(http: httpx.AsyncClient) -> tuple[int, float]:
        start = time.monotonic()
        try:
            r = await http.post("/v1/chat/completions", json=body, timeout=args.timeout_s)
            return r.status_code, time.monotonic() - start
        except httpx.HTTPError:
            return 0, time.monotonic() - start

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, trust_env=False, limits=limits) as http:
        before = [(await one(http))[1] for _ in range(3)]
        n = max(1, int(args.burst * capacity))
        burst = list(await asyncio.gather(*(one(http) for _ in range(n))))
        after = [(await one(http))[1] for _ in range(3)]
    return burst_report(burst, before, after)


async def held_after(model: str) -> dict[str, object]:
    from ray import serve

    from cluster.cache_shards import cache_index_args, open_cache_index
    from cluster.config import ModelConfig

    llm = await serve.get_deployment_handle(f"LLMServer-{model}", app_name="mmserve").stats.remote()
    cache = await open_cache_index(*cache_index_args(ModelConfig(name=model, tiny="qwen2-vl"))).stats()
    return {
        "running": llm["num_running"],
        "waiting": llm["num_waiting"],
        "kv_blocks_held": llm["num_total_blocks"] - llm["num_free_blocks"],
        "reserved": cache["reserved"],
    }


FAULT_HEADERS = [
    "killed",
    "sent",
    "ok",
    "failed",
    "lost (hung)",
    "failed in flight at kill",
    "TTFT p50/p99 before (ms)",
    "TTFT p50/p99 after (ms)",
    "first ok after (s)",
    "throughput back (s)",
]
BURST_HEADERS = [
    "burst sent",
    "503",
    "ok",
    "other",
    "503 p50/p99 (ms)",
    "accepted p50 (s)",
    "e2e before/after (s)",
]


def fault_row(f: FaultReport) -> list[str]:
    counts = [f.target, str(f.sent), str(f.ok), str(f.failed), str(f.lost), str(f.failed_in_flight)]
    ttft = [
        f"{fmt_ms(f.ttft_p50_before)} / {fmt_ms(f.ttft_p99_before)}",
        f"{fmt_ms(f.ttft_p50_after)} / {fmt_ms(f.ttft_p99_after)}",
    ]
    return counts + ttft + [fmt_num(f.first_ok_after_s, 1), fmt_num(f.recovered_s, 1)]


def burst_row(b: BurstReport) -> list[str]:
    return [
        str(b.sent),
        f"{b.refused} ({100 * b.refused / max(1, b.sent):.0f} %)",
        str(b.ok),
        str(b.other_failures),
        f"{fmt_ms(b.refusal_p50_s)} / {fmt_ms(b.refusal_p99_s)}",
        fmt_num(b.accepted_p50_s),
        f"{fmt_num(b.e2e_before_s)} / {fmt_num(b.e2e_after_s)}",
    ]


def render(
    faults: list[FaultReport], burst: BurstReport | None, held: Mapping[str, object], per_item: str
) -> str:
    out = [markdown_table(FAULT_HEADERS, [fault_row(f) for f in faults])] if faults else []
    out += [f"- {f.target} error: {e}" for f in faults for e in f.errors]
    if burst is not None:
        out += ["", markdown_table(BURST_HEADERS, [burst_row(burst)])]
    out += ["", f"held after the run: {held}; encoder forwards per distinct item: {per_item}"]
    return "\n".join(out)


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


async def amain(args: argparse.Namespace) -> str:
    from cluster.config import AppConfig, default_config
    from cluster.serve_cli import start

    cfg = AppConfig.from_yaml(args.config) if args.config else default_config()
    data = {**cfg.model_dump(), "host": "127.0.0.1", "port": args.port}
    if "http_mode" not in cfg.ingress.model_fields_set:
        data["ingress"]["http_mode"] = "direct"
    if args.max_concurrent is not None:
        data["ingress"]["admission"]["max_concurrent_requests"] = args.max_concurrent
    cfg = AppConfig.model_validate(data)
    log("starting the app on an embedded Ray ...")
    await asyncio.to_thread(start, cfg, args.num_cpus)
    base = f"http://127.0.0.1:{args.port}"
    client = make_client(base + "/v1", args.timeout_s)
    specs = workload(args)
    before = await fetch_counters(base + "/v1")
    media: set[int] = set()
    for s in specs[:6]:  # warm every path once
        media.update(media_keys(s))
        await send_request(client, s, args.max_tokens)
    faults = []
    for kind in [k.strip() for k in args.kill.split(",") if k.strip()]:
        if kind not in KINDS:
            raise SystemExit(f"--kill: unknown kind {kind!r}; one of {KINDS}")
        faults.append(await run_fault(args, client, specs, kind, media))
    burst = None
    if args.burst > 0:
        capacity = cfg.ingress.admission.max_concurrent_requests * len(_serve_replicas("IngressServer"))
        burst = await run_burst(args, base, capacity)
    await asyncio.sleep(6)  # channels linger 5 s; expired reservations are swept on read
    held = await held_after(args.model)
    after = await fetch_counters(base + "/v1")
    per_item = "n/a"
    if before and after:
        forwards = after["encoder_items_dispatched"] - before["encoder_items_dispatched"]
        per_item = f"{forwards / max(1, len(media)):.2f} ({forwards} forwards, {len(media)} distinct items)"
    return render(faults, burst, held, per_item)


async def run(args: argparse.Namespace) -> str:
    """The whole run; Serve is shut down on the loop its handles live on (after the loop, their
    long-poll threads find it closed and Ray's exit hangs)."""
    from ray import serve

    try:
        return await amain(args)
    finally:
        await serve.shutdown_async()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        print(asyncio.run(run(args)), flush=True)
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
