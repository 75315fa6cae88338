"""Target: the direct link's header frame, the bytes a peer sends before anything is unpickled.

``frames.decode_header`` (msgpack, then the shape check), then the reads each end makes of a
decoded header: the server's ``[seq, method, timeout_ms]`` (``LinkServer._take``) and the client's
``[seq, status, code, message]`` (``LinkClient._decode``), as they are written there. A body frame is
unpickled only from a peer that passed the CURVE handshake (mmcore/link/direct_link.py), so it is
not fuzzed.
Expected: None (dropped, counted as garbled) or a header whose reads raise nothing.
"""

from __future__ import annotations

# The one import of the link (it moved from router/link_wire.py: change this line only).
from mmcore.link import frames as link_wire


def _server_reads(header: list[object]) -> None:
    method = header[1]
    if method is None:  # a cancel
        return
    if not isinstance(method, str):
        return  # refused as a bad frame
    timeout_ms = header[2] if len(header) > 2 else None
    if isinstance(timeout_ms, int) and timeout_ms > 0:
        float(timeout_ms / 1000)  # loop.call_later's delay


def _client_reads(header: list[object]) -> None:
    status = header[1]
    if status == link_wire.FAILED:
        code, message = (header[2], header[3]) if len(header) > 3 else ("bad_frame", repr(header))
        link_wire.FAILURES.get(str(code), link_wire.BadFrame)(message)
        return
    if status in (link_wire.OK, link_wire.MORE):
        return
    link_wire.BadFrame(f"an error reply that is no exception: {header!r}")


def one_input(data: bytes) -> None:
    decoded = link_wire.decode_header(data)
    if decoded is None:
        return
    seq, header = decoded
    if not isinstance(seq, int) or header[0] is not seq or len(header) < 2:
        raise AssertionError(f"decode_header gave {decoded!r}")
    _server_reads(header)
    _client_reads(header)
