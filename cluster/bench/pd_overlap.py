"""How much of the KV hand-off the chunk-by-chunk pull hides: ``python -m cluster.bench.pd_overlap``.

One process plays a prefill replica and a decode replica (two ``LLMServer``s, one torch thread each,
their engines on their own threads) and the replicas' direct link between them (mmcore/link, ZeroMQ
on loopback with CURVE, as the app's keys are by default). For each mode, plain (the pull starts
once the prefill has ended) and ``kv_pull_chunks`` (the prefill replica answers at once, the decode
replica pulls each chunk's blocks while the next chunk computes), it hands off ``--repeat`` prompts of
``--tokens`` random tokens (no prefix shared) computed in chunks of ``--chunk`` tokens and prints per
request: the prefill's time after its first chunk, ``kv_pull_wall_s`` (the decode replica's reserve to
admit), and what is left exposed: from the prefill's first token to the decode replica admitting the
request (its first output goes out on the next step), the hand-off time TTFT pays; and the KV moved
per request (MiB) and its CPU time on both sides (the prefill side's read or send thread, the decode
side's write or receive thread; and, plain, the whole process's CPU time over the import, the I/O
threads of ZeroMQ or gloo included, the engines being idle then). ``--collective``: a third mode, plain over a gloo pair group
(``llm.kv_transfer: collective``, llm_service/serve/kv_pair.py) instead of the link.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from llm_service.config import EngineConfig
from llm_service.request_spec import LLMRequestSpec
from llm_service.sampling_params import SamplingParams
from llm_service.serve.deployment import HandoffWiring, LLMServer
from mmcore.link.direct_link import DirectLink, LinkServer
from mmcore.link.frames import LinkKeys

DEFAULT_MODEL = "/tmp/pdbench/epd-qwen2-vl"  # docs/benchmarks.md's make-tiny-model of the E/P/D runs


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    blocks = 2 * args.repeat * (-(-(args.tokens + 8) // args.block_size)) + 16
    return EngineConfig(
        model=args.model,
        block_size=args.block_size,
        num_kv_blocks=blocks,
        max_num_batched_tokens=args.chunk,
        max_model_len=args.tokens + 64,
    )


def _timed_steps(server: LLMServer, marks: dict[str, list[float]]) -> None:
    """Stamp each engine step's end per request it computed (the prefill's chunks)."""
    engine: Any = server.engine
    schedule, step = engine.scheduler.schedule, engine.step
    last: list[list[str]] = [[]]

    def scheduled() -> Any:
        out = schedule()
        last[0] = [c.request.request_id for c in out.chunks]
        return out

    def stamped() -> Any:
        outs = step()
        now = time.perf_counter()
        for rid in last[0]:
            marks.setdefault(rid, []).append(now)
        return outs

    engine.scheduler.schedule, engine.step = scheduled, stamped


async def _run(args: argparse.Namespace, chunks: bool, transfer: str = "link") -> list[dict[str, float]]:
    keys = LinkKeys.generate(encrypt=True)
    holder: dict[str, LLMServer] = {}

    async def address() -> tuple[str, int]:
        return await server.address("127.0.0.1")

    async def pull_kv(*a: Any) -> Any:
        return await holder["p"].pull_kv(*a)

    async def pull_kv_chunks(*a: Any) -> Any:
        return await holder["p"].pull_kv_chunks(*a)

    async def kv_pair_join(*a: Any) -> Any:
        return await holder["p"].kv_pair_join(*a)

    async def kv_send(*a: Any) -> Any:
        return await holder["p"].kv_send(*a)

    handlers = {"pull_kv": pull_kv, "pull_kv_chunks": pull_kv_chunks, "kv_pair_join": kv_pair_join}
    server = LinkServer({**handlers, "kv_send": kv_send}, keys)
    links: dict[tuple[str, int], DirectLink] = {}

    def connect(addr: tuple[str, int]) -> DirectLink:
        if addr not in links:

            async def locate() -> tuple[str, int]:
                return addr

            links[addr] = DirectLink(locate, keys)
        return links[addr]

    wiring = HandoffWiring(
        address, connect, deadline_s=60.0, timeout_s=60.0, pull_chunks=chunks, transfer=transfer
    )
    prefill = holder["p"] = LLMServer(_engine_config(args), "bench", role="prefill", handoff=wiring)
    decode = LLMServer(_engine_config(args), "bench", role="decode", handoff=wiring)
    marks: dict[str, list[float]] = {}
    _timed_steps(prefill, marks)
    assert decode._decode is not None
    rng = random.Random(0)
    vocab = min(prefill.engine.vocab_size, 4000) if hasattr(prefill.engine, "vocab_size") else 4000  # type: ignore[attr-defined]
    rows = []
    for i in range(args.repeat + 1):  # the first one warms up
        rid = f"{'c' if chunks else 'p'}{i}"
        prompt = [rng.randrange(10, vocab) for _ in range(args.tokens)]
        spec = LLMRequestSpec(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        pull0 = decode.kv_stats.pull_wall_s
        cpu0 = decode.kv_stats.import_cpu_s + prefill.kv_stats.export_cpu_s
        bytes0 = decode.kv_stats.bytes_pulled
        t0 = time.perf_counter()
        handoff = await prefill.prefill(spec)
        c0 = time.process_time()  # plain: the engines idle now, so this is the transfer's, every thread's
        await decode._decode.import_request(replace(spec, handoff=handoff))
        import_cpu_s = time.process_time() - c0
        admitted = time.perf_counter()
        steps = marks.pop(rid)
        decode.loop.abort(rid)
        await asyncio.sleep(0.05)  # the prefill side's send thread counts its CPU time as it ends
        if i:
            rows.append(
                {
                    "prefill_s": steps[-1] - t0,
                    "after_first_chunk_s": steps[-1] - steps[0],
                    "pull_wall_s": decode.kv_stats.pull_wall_s - pull0,
                    "exposed_s": admitted - steps[-1],
                    "overlapped_blocks": float(decode.kv_stats.blocks_overlapped),
                    "kv_cpu_s": decode.kv_stats.import_cpu_s + prefill.kv_stats.export_cpu_s - cpu0,
                    "kv_mib": (decode.kv_stats.bytes_pulled - bytes0) / 2**20,
                    "process_cpu_s": import_cpu_s,
                }
            )
    for link in links.values():
        link.close()
    await server.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--collective", action="store_true", help="and plain over a gloo pair group")
    args = ap.parse_args()
    if not Path(args.model).exists():
        raise SystemExit(f"{args.model}: no model there (docs/benchmarks.md: make-tiny-model)")
    torch.set_num_threads(1)
    print(f"{args.model}: {args.tokens}-token prompts in chunks of {args.chunk}, block {args.block_size}")
    print(
        "| mode | prefill ms | prefill after its first chunk ms | kv_pull_wall_s ms | exposed after the prefill ms "
        "| KV MiB | KV CPU ms (read/send + write/recv threads) | process CPU ms over the import (plain) |"
    )
    print("| :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    modes = [("plain", False, "link"), ("kv_pull_chunks", True, "link")]
    for name, chunks, transfer in modes + ([("collective", False, "collective")] if args.collective else []):
        rows = asyncio.run(_run(args, chunks, transfer))
        if args.verbose:
            print(rows)

        def med(key: str, rows: list[dict[str, float]] = rows, scale: float = 1000.0) -> float:
            return scale * statistics.median(r[key] for r in rows)

        print(
            f"| {name} | {med('prefill_s'):.0f} | {med('after_first_chunk_s'):.0f} | "
            f"{med('pull_wall_s'):.1f} | {med('exposed_s'):.1f} | {med('kv_mib', scale=1.0):.2f} | {med('kv_cpu_s'):.1f} | "
            + ("—" if chunks else f"{med('process_cpu_s'):.1f}")
            + " |"
        )


if __name__ == "__main__":
    main()
