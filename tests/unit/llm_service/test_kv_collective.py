"""The KV hand-off over torch.distributed (llm_service/kv_collective.py) on gloo, two CPU processes:
blocks sent out of one paged cache land in other block ids of another, every layer's K and V, and
nothing else of the receiving cache changes. tests/gpu/test_kv_nccl.py runs it on NCCL."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SRC_IDS = [3, 7, 1, 4]
DST_IDS = [0, 5, 2, 6]
SHAPES = [(2, 8, 4, 2, 8), (2, 8, 4, 1, 16)]  # two layers: (K|V, blocks, block_size, heads, head_dim)


def caches(seed: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device) for s in SHAPES]


def rank_main(rank: int, port: int, backend: str, out: str) -> None:
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from llm_service.kv_collective import recv_blocks, send_blocks

    kv = caches(seed=rank, device=device)
    if rank == 0:
        sent = send_blocks(kv, SRC_IDS, dst=1)
        assert sent == sum(2 * len(SRC_IDS) * s[2] * s[3] * s[4] * 4 for s in SHAPES)
    else:
        recv_blocks(kv, DST_IDS, src=0)
        torch.save([c.cpu() for c in kv], Path(out) / "received.pt")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_received(out: Path) -> None:
    got = torch.load(out / "received.pt")
    sender, before = caches(seed=0, device="cpu"), caches(seed=1, device="cpu")
    for recv, src, old in zip(got, sender, before, strict=True):
        for s, d in zip(SRC_IDS, DST_IDS, strict=True):
            assert torch.equal(recv[:, d], src[:, s])  # K and V of the block, moved
        untouched = [b for b in range(recv.shape[1]) if b not in DST_IDS]
        assert torch.equal(recv[:, untouched], old[:, untouched])


@pytest.mark.slow
def test_blocks_move_between_paged_caches_on_gloo(tmp_path: Path) -> None:
    mp.spawn(rank_main, args=(free_port(), "gloo", str(tmp_path)), nprocs=2)
    check_received(tmp_path)
