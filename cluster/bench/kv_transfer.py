"""What an E/P/D hand-off's KV pull costs: ``python -m cluster.bench.kv_transfer``.

One process plays both replicas: a prefill side's paged KV cache and a decode side's, each
``[2, blocks, block_size, kv_heads, head_dim]`` per layer of the model shape given (default: a
Qwen2-VL-2B-sized decoder, 28 layers of 2 KV heads of 128 in bfloat16), and between them the
replicas' direct link (mmcore/link, ZeroMQ on loopback with CURVE, as the app's keys are by default).
For each prompt length it pulls the prompt's blocks ``--repeat`` times and prints per pull: MiB moved,
wall ms and this process's CPU ms (both ends of the link, the ZeroMQ I/O threads included), split into
the read on the prefill side (``index_select`` to host, bytes), the call, and the write into the decode
side's blocks. ``--transfer collective``: the same blocks on a two-rank gloo pair group instead
(llm_service/serve/kv_pair.py's ``llm.kv_transfer: collective``), each rank on a thread of this process,
twice: the blocks in one run on both sides (one op per layer and K|V), and scattered (one op per block),
sent straight out of one cache and received straight into the other (read ms: the send's thread, write
ms: the receive's). The serving path's numbers on the tiny model are
``tests/integration/test_pd_families.py``'s (link) and ``test_pd_collective.py``'s (collective).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from types import SimpleNamespace
from typing import Any

import torch

from llm_service.kv_handoff import KVBlocks
from llm_service.kv_io import DTYPES, read_kv_blocks, write_kv_blocks
from mmcore.link.direct_link import DirectLink, LinkServer
from mmcore.link.frames import LinkKeys


def _side(layers: int, heads: int, head_dim: int, blocks: int, block_size: int, dtype: str) -> Any:
    """What ``kv_io.read_kv_blocks`` / ``write_kv_blocks`` read of a runner: its caches and dtype."""
    caches = [torch.randn(2, blocks, block_size, heads, head_dim).to(DTYPES[dtype]) for _ in range(layers)]
    return SimpleNamespace(
        kv_caches=caches, config=SimpleNamespace(dtype=dtype), window=None, device=torch.device("cpu")
    )


def _row(
    tokens: int, blocks: int, nbytes: int, repeat: int, wall: float, cpu: float, read: float, write: float
) -> dict[str, float]:
    """One size's table row: totals over ``repeat`` transfers, per transfer in ms."""
    per = 1000 / repeat
    return {
        "tokens": tokens,
        "blocks": blocks,
        "mib": nbytes / 2**20,
        "wall_ms": per * wall,
        "cpu_ms": per * cpu,
        "read_ms": per * read,
        "write_ms": per * write,
    }


async def _measure(args: argparse.Namespace, tokens: int) -> dict[str, float]:
    n = -(-tokens // args.block_size)
    blocks = max(2 * n, 8)
    prefill = _side(args.layers, args.kv_heads, args.head_dim, blocks, args.block_size, args.dtype)
    decode = _side(args.layers, args.kv_heads, args.head_dim, blocks, args.block_size, args.dtype)
    src, dst = list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))
    read_s = [0.0]

    async def pull_kv(request_id: str, from_block: int) -> KVBlocks:
        t0 = time.thread_time()
        out = read_kv_blocks(prefill, request_id, src[from_block:], from_block)
        read_s[0] += time.thread_time() - t0
        return out

    keys = LinkKeys.generate(encrypt=not args.plain)
    server = LinkServer({"pull_kv": pull_kv}, keys)
    address = await server.address("127.0.0.1")

    async def locate() -> tuple[str, int]:
        return address

    link = DirectLink(locate, keys)
    await link.call("pull_kv", "warm", 0)
    wall = cpu = write = 0.0
    nbytes = 0
    for i in range(args.repeat):
        c0, w0 = time.process_time(), time.perf_counter()
        got: KVBlocks = await link.call("pull_kv", f"r{i}", 0)
        t0 = time.thread_time()
        write_kv_blocks(decode, dst, got)
        write += time.thread_time() - t0
        wall += time.perf_counter() - w0
        cpu += time.process_time() - c0
        nbytes = got.nbytes
    assert torch.equal(decode.kv_caches[0][:, dst[-1]], prefill.kv_caches[0][:, src[-1]])
    link.close()
    await server.close()
    return _row(tokens, n, nbytes, args.repeat, wall, cpu, read_s[0] * args.repeat / (args.repeat + 1), write)


def _measure_collective(args: argparse.Namespace, tokens: int, scattered: bool) -> dict[str, float]:
    from concurrent.futures import ThreadPoolExecutor

    from llm_service.kv_collective import kv_parts, recv_tensors, send_tensors
    from llm_service.serve.kv_pair import DECODE_RANK, PREFILL_RANK, build_group, host_store, join_store

    n = -(-tokens // args.block_size)
    blocks = max(2 * n, 8)
    prefill = _side(args.layers, args.kv_heads, args.head_dim, blocks, args.block_size, args.dtype)
    decode = _side(args.layers, args.kv_heads, args.head_dim, blocks, args.block_size, args.dtype)
    # scattered: no two blocks consecutive on both sides, one op per block (the link's layout above);
    # else one run (a fresh pool's allocation): one op per layer and K|V
    src, dst = (
        (list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2)))
        if scattered
        else (list(range(n)), list(range(n, 2 * n)))
    )
    store = host_store("127.0.0.1", 60)
    client = join_store("127.0.0.1", int(store.port), 60)
    with ThreadPoolExecutor(1) as pool:
        mine = pool.submit(build_group, store, "bench", DECODE_RANK, "gloo", "127.0.0.1", 60)
        sender = build_group(client, "bench", PREFILL_RANK, "gloo", "127.0.0.1", 60)
        receiver = mine.result()
        out, into = kv_parts(prefill, src, peer_block_ids=dst), kv_parts(decode, dst, peer_block_ids=src)

        def timed_recv() -> tuple[int, float]:
            t0 = time.thread_time()
            got = recv_tensors(into, PREFILL_RANK, receiver)
            return got, time.thread_time() - t0

        wall = cpu = read = write = 0.0
        nbytes = 0
        for i in range(args.repeat + 1):  # the first warms the pair's connections up
            c0, w0 = time.process_time(), time.perf_counter()
            recv = pool.submit(timed_recv)
            t0 = time.thread_time()
            send_tensors(out, DECODE_RANK, sender)
            sent_s = time.thread_time() - t0
            nbytes, recv_s = recv.result()
            if i:
                wall += time.perf_counter() - w0
                cpu += time.process_time() - c0
                read, write = read + sent_s, write + recv_s
    assert torch.equal(decode.kv_caches[0][:, dst[-1]], prefill.kv_caches[0][:, src[-1]])
    return _row(tokens, n, nbytes, args.repeat, wall, cpu, read, write)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument(
        "--plain", action="store_true", help="PLAIN keys (authenticated, in clear) instead of CURVE"
    )
    p.add_argument(
        "--transfer",
        choices=["link", "collective", "both"],
        default="link",
        help="llm.kv_transfer: the link (default), a gloo pair group, or both one after the other",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    print("| transfer | prompt tokens | blocks | MiB | wall ms | CPU ms (both ends) | read ms | write ms |")
    print("| :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    chosen = ["link", "collective"] if args.transfer == "both" else [args.transfer]
    transfers = [
        t for x in chosen for t in ([x] if x == "link" else ["collective, runs", "collective, scattered"])
    ]
    for tokens in args.tokens:
        for transfer in transfers:
            m = (
                asyncio.run(_measure(args, tokens))
                if transfer == "link"
                else _measure_collective(args, tokens, scattered=transfer.endswith("scattered"))
            )
            print(
                f"| {transfer} | {m['tokens']} | {m['blocks']:.0f} | {m['mib']:.1f} | {m['wall_ms']:.1f} "
                f"| {m['cpu_ms']:.1f} | {m['read_ms']:.1f} | {m['write_ms']:.1f} |"
            )


if __name__ == "__main__":
    main()
