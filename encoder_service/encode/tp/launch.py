"""Joining an encoder TP group: pick a rendezvous port, init torch.distributed with the right backend."""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from typing import NoReturn

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


def leave_tp_process_group(barrier: bool = True) -> None:
    """Leave the group: wait for every rank (``barrier``), then destroy it."""
    if not dist.is_initialized():
        return
    if barrier:
        dist.barrier()
    dist.destroy_process_group()


def exit_spawned_rank() -> NoReturn:
    """End a rank process started by ``torch.multiprocessing.spawn`` once its results are on disk.

    Leaves the group, then exits at once with status 0: left to the interpreter's teardown, a gloo
    rank aborts now and then (SIGABRT, "terminate called without an active exception", from a C++
    thread destroyed unjoined at exit) after its work is done, and spawn reports the rank failed.
    """
    leave_tp_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
