"""The encoder TP group's rendezvous store listens on the node's own address only (issue 50, item 8):
torch's ``tcp://`` rendezvous serves its store on every interface whatever host it is given."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from encoder_service.encode.tp.launch import (
    free_port,
    init_tp_process_group,
    leave_tp_process_group,
    rendezvous_address,
)


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net shows them) of the sockets listening on TCP ``port``."""
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            addr, _, hex_port = cols[1].rpartition(":")
            if cols[3] == "0A" and int(hex_port, 16) == port:
                found.add(addr)
    return found


def test_rank_0s_store_listens_on_loopback_alone_and_serves_the_group() -> None:
    port = free_port("127.0.0.1")
    init_tp_process_group(f"tcp://127.0.0.1:{port}", 0, 1, "gloo", timeout_s=30)
    try:
        assert dist.get_world_size() == 1
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0 or [::]
        peer = dist.TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=10))  # as a rank 1 joins
        peer.set("seen", "yes")
        assert peer.get("seen") == b"yes"
    finally:
        leave_tp_process_group(barrier=False)
    assert not dist.is_initialized()


def test_rendezvous_addresses_parse_and_bad_ones_are_refused() -> None:
    assert rendezvous_address("tcp://10.0.0.7:29500") == ("10.0.0.7", 29500)
    assert rendezvous_address("tcp://[fd00::1]:29500") == ("fd00::1", 29500)
    for bad in ("env://", "tcp://host", "tcp://:80", "file:///tmp/x", "tcp://h:port"):
        with pytest.raises(ValueError, match="tcp://host:port"):
            rendezvous_address(bad)
