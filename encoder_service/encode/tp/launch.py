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


def rendezvous_address(init_method: str) -> tuple[str, int]:
    """``tcp://host:port`` (or ``tcp://[v6]:port``) -> (host, port); anything else is a ValueError."""
    if not init_method.startswith("tcp://"):
        raise ValueError(f"encoder TP rendezvous must be tcp://host:port, got {init_method!r}")
    host, sep, port = init_method.removeprefix("tcp://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"encoder TP rendezvous must be tcp://host:port, got {init_method!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def rendezvous_store(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The group's TCP store. Rank 0 serves it on ``host`` alone (the node's own address: loopback, or
    its IP where ranks span nodes): torch's own ``tcp://`` rendezvous binds its server to every
    interface whatever the host, so rank 0 binds the socket here and hands torch the listening fd."""
    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(max(128, world_size))
    except BaseException:
        sock.close()
        raise
    # the store owns the fd from here (detach: the socket object will not close it)
    return dist.TCPStore(
        host, port, world_size, True, timeout, wait_for_workers=False, master_listen_fd=sock.detach()
    )


def init_tp_process_group(
    init_method: str, rank: int, world_size: int, backend: str, timeout_s: float = 300.0
) -> None:
    """Join the group (blocks until all ``world_size`` ranks have joined ``init_method``, e.g. tcp://h:p);
    rank 0's rendezvous store listens on that host only (``rendezvous_store``)."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group")
    host, port = rendezvous_address(init_method)
    dist.init_process_group(
        backend=backend,
        store=rendezvous_store(host, port, rank, world_size, timeout_s),
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
