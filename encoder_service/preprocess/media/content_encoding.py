"""Undo an HTTP ``Content-Encoding`` incrementally, never holding more than the cap (gzip bombs).

httpx inflates each received chunk whole, so one 64 KB gzip chunk became ~64 MB before any size check.
Here every ``decompress`` call is bounded by the room left under ``max_bytes`` (zlib's ``max_length``),
so the decoded body is refused the moment it passes the cap, holding at most the cap plus one byte.
Only gzip and deflate are undone (and asked for); br and zstd have no bounded decoder here and are
refused with 415.
"""

from __future__ import annotations

import zlib

from encoder_service.preprocess.errors import MediaFetchError, MediaTooLarge, UnsupportedMediaType

ACCEPT_ENCODING = "gzip, deflate"


class CappedDecoder:
    """``feed(chunk)`` → decoded bytes; ``finish()`` → the rest. Raises 413 past ``cap`` decoded bytes."""

    def __init__(self, content_encoding: str | None, cap: int, label: str, item: int | None) -> None:
        self.cap, self.label, self.item = cap, label, item
        self.size = 0
        codings = [c.strip().lower() for c in (content_encoding or "").split(",")]
        codings = [c for c in codings if c and c != "identity"]
        if len(codings) > 1:
            raise UnsupportedMediaType(f"{label}: stacked Content-Encoding {content_encoding!r}", item=item)
        self.coding = codings[0] if codings else None
        self._z: zlib._Decompress | None = None
        if self.coding in ("gzip", "x-gzip"):
            self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif self.coding not in (None, "deflate"):
            raise UnsupportedMediaType(
                f"{label}: Content-Encoding {self.coding!r} is not supported (gzip, deflate)", item=item
            )

    def _count(self, n: int) -> None:
        self.size += n
        if self.size > self.cap:
            raise MediaTooLarge(
                f"{self.label}: the response decodes to more than max_bytes={self.cap} bytes", item=self.item
            )

    def feed(self, chunk: bytes) -> bytes:
        if self.coding is None:
            self._count(len(chunk))
            return chunk
        if not chunk:
            return b""
        if self._z is None:  # "deflate" is zlib-wrapped by the RFC; some servers send it raw
            self._z = zlib.decompressobj(zlib.MAX_WBITS if _looks_zlib(chunk) else -zlib.MAX_WBITS)
        out, data = [], chunk
        try:
            while data and not self._z.eof:
                piece = self._z.decompress(data, self.cap - self.size + 1)
                self._count(len(piece))
                out.append(piece)
                data = self._z.unconsumed_tail
        except zlib.error as e:
            raise MediaFetchError(
                f"{self.label}: {self.coding} response does not decode: {e}", item=self.item
            ) from e
        return b"".join(out)

    def finish(self) -> bytes:
        if self.coding is None:
            return b""
        if self._z is None or not self._z.eof:
            raise MediaFetchError(f"{self.label}: {self.coding} response is truncated", item=self.item)
        return b""


def _looks_zlib(head: bytes) -> bool:
    """A zlib header: CM=8 (deflate) and the 16-bit header divisible by 31."""
    return len(head) >= 2 and head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0
