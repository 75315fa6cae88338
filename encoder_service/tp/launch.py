"""Joining an encoder TP group: pick a rendezvous port, init torch.distributed with the right backend."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on ``host`` a moment ago (the TCP store binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def default_backend(device: str) -> str:
    """NCCL when this rank runs on CUDA, gloo on the CPU."""
    on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "nccl" if on_cuda else "gloo"


def init_tp_process_group(
    init_method: str, rank: int, world_size: int, backend: str, timeout_s: float = 300.0
) -> None:
    """Join the group (blocks until all ``world_size`` ranks have joined ``init_method``, e.g. tcp://h:p)."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group")
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
