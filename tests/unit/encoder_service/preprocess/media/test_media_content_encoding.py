"""Compressed responses (issue 11, item 10): decompressed incrementally under the cap; bombs are 413.

A loopback HTTP server started here serves a gzip bomb (64 MB of zeros in ~64 KB), ordinary gzip and
deflate bodies, and encodings we do not undo. Nothing but 127.0.0.1 is contacted.
"""

from __future__ import annotations

import gzip
import threading
import tracemalloc
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from encoder_service.preprocess.errors import MediaError, MediaFetchError, MediaTooLarge, UnsupportedMediaType
from encoder_service.preprocess.media import MediaLimits, load_media_sync
from encoder_service.preprocess.media.content_encoding import CappedDecoder
from encoder_service.types import MediaRef
from tests.media import make_audio_bytes

WAV = make_audio_bytes(0.5)
BOMB = gzip.compress(b"\0" * (64 << 20), compresslevel=9)
_raw = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
BODIES = {
    "/bomb.wav": (BOMB, "gzip"),
    "/gzip.wav": (gzip.compress(WAV), "gzip"),
    "/deflate.wav": (zlib.compress(WAV), "deflate"),
    "/rawdeflate.wav": (_raw.compress(WAV) + _raw.flush(), "deflate"),
    "/br.wav": (b"\x1b\x03\x00\xf8\xa5@\x00", "br"),
    "/stacked.wav": (gzip.compress(gzip.compress(WAV)), "gzip, gzip"),
    "/truncated.wav": (gzip.compress(WAV)[:-40], "gzip"),
}


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        body, coding = BODIES[self.path]
        self.send_response(200)
        self.send_header("Content-Type", "audio/wav")
        self.send_header("Content-Encoding", coding)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


LIMITS = MediaLimits(allow_private_addresses=True, max_bytes=1 << 20, fetch_timeout_s=20.0)


def _load(server, path, limits=LIMITS):
    return load_media_sync(MediaRef("audio", url=server + path), limits, item=5)


def test_gzip_bomb_is_413_with_bounded_memory(server):
    assert len(BOMB) < 100_000
    tracemalloc.start()
    try:
        with pytest.raises(MediaTooLarge, match=r"^audio 5: the response decodes to more than") as e:
            _load(server, "/bomb.wav")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.value.status_code == 413
    assert peak < 8 * LIMITS.max_bytes  # the old path inflated a whole 64 KB chunk: ~64 MB at once


@pytest.mark.parametrize("path", ["/gzip.wav", "/deflate.wav", "/rawdeflate.wav"])
def test_ordinary_compressed_bodies_decode_to_the_original(server, path):
    got = _load(server, path)
    assert got.data == WAV and got.value.shape == (8000,)


@pytest.mark.parametrize(
    ("path", "exc", "status"),
    [
        ("/br.wav", UnsupportedMediaType, 415),
        ("/stacked.wav", UnsupportedMediaType, 415),
        ("/truncated.wav", MediaFetchError, 400),
    ],
)
def test_encodings_we_do_not_undo_are_4xx(server, path, exc, status):
    with pytest.raises(exc) as e:
        _load(server, path)
    assert e.value.status_code == status and e.value.item == 5


def test_capped_decoder_never_returns_more_than_the_cap_plus_one():
    dec = CappedDecoder("gzip", 1000, "image", 0)
    out = 0
    with pytest.raises(MediaTooLarge):
        for i in range(0, len(BOMB), 4096):
            piece = dec.feed(BOMB[i : i + 4096])
            out += len(piece)
            assert out <= 1001
    identity = CappedDecoder(None, 10, "image", 0)
    assert identity.feed(b"12345") == b"12345"
    with pytest.raises(MediaTooLarge):
        identity.feed(b"123456")
    with pytest.raises(MediaError):
        CappedDecoder("zstd", 10, "image", 0)
