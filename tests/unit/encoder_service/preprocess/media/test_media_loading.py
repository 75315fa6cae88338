"""Media loading: every input form decodes, every limit fires with its own error and status.

HTTP tests use a loopback server this module starts; nothing else is ever contacted.
"""

from __future__ import annotations

import base64
import contextlib
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from encoder_service.preprocess.errors import (
    MediaDecodeError,
    MediaError,
    MediaFetchTimeout,
    MediaTooLarge,
    UnsupportedMediaType,
    URLNotAllowed,
)
from encoder_service.preprocess.media import MediaLimits, load_media_sync
from encoder_service.types import MediaRef
from tests.media import make_audio_bytes, make_image_bytes, make_video_bytes

IMG = make_image_bytes(64, 48)
VID = make_video_bytes(64, 48, num_frames=8, fps=4)
WAV = make_audio_bytes(1.5)


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, body: bytes, ctype: str = "application/octet-stream") -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/img.png":
            self._send(IMG, "image/png")
        elif self.path == "/clip.mp4":
            self._send(VID, "video/mp4")
        elif self.path == "/a.wav":
            self._send(WAV, "audio/wav")
        elif self.path == "/stream-forever":  # no Content-Length: the cap must hold while streaming
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(1000):
                    self.wfile.write(b"x" * 4096)
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass
        elif self.path == "/stall":
            time.sleep(3)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self._send(IMG)
        elif self.path.startswith("/redirect?to="):
            self.send_response(302)
            self.send_header("Location", self.path.split("=", 1)[1])
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.send_error(404)


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


LOOP = MediaLimits(allow_private_addresses=True, fetch_timeout_s=5.0)


def _load(modality, limits=LOOP, **ref):
    return load_media_sync(MediaRef(modality, **ref), limits, item=2)


def test_image_every_form(server, tmp_path):
    (tmp_path / "i.png").write_bytes(IMG)
    forms = [
        {"data": IMG},
        {"url": "data:image/png;base64," + base64.b64encode(IMG).decode()},
        {"url": f"{server}/img.png"},
        {"url": f"{server}/redirect?to=/img.png"},
        {"url": f"file://{tmp_path}/i.png"},
    ]
    limits = MediaLimits(allow_private_addresses=True, allowed_local_media_path=str(tmp_path))
    arrays = [np.asarray(_load("image", limits, **f).value) for f in forms]
    assert arrays[0].shape == (48, 64, 3)
    assert all(np.array_equal(arrays[0], a) for a in arrays[1:])


def test_video_and_audio_forms(server):
    for ref in ({"data": VID}, {"url": f"{server}/clip.mp4"}):
        v = _load("video", **ref)
        assert v.value.shape == (4, 48, 64, 3) and v.metadata["seconds"] == 2.0  # 2 s at video_fps=2
    webm = make_video_bytes(64, 48, num_frames=5, fps=5, container="webm")
    w = load_media_sync(MediaRef("video", data=webm), MediaLimits(video_num_frames=3))
    assert w.value.shape[0] == 3
    w2 = load_media_sync(MediaRef("video", data=webm), MediaLimits(video_num_frames=3), frame_multiple=2)
    assert w2.value.shape[0] == 4  # rounded up to Qwen2-VL's temporal_patch_size
    for ref in ({"data": WAV, "format": "wav"}, {"url": f"{server}/a.wav"}):
        a = _load("audio", **ref)
        assert a.value.dtype == np.float32 and a.value.shape == (24000,)
    resampled = _load("audio", data=make_audio_bytes(1.0, sr=8000, fmt="FLAC"))
    assert resampled.value.shape == (16000,) and resampled.metadata["orig_sampling_rate"] == 8000


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares ``width`` x ``height`` and whose pixel data is missing (a bomb header)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    out = b"\x89PNG\r\n\x1a\n"
    for kind, body in ((b"IHDR", ihdr), (b"IDAT", zlib.compress(b"\x00" * 16)), (b"IEND", b"")):
        out += struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return out


def _raises(exc, status, match, fn, *args, **kw):
    with pytest.raises(exc, match=match) as e:
        fn(*args, **kw)
    assert e.value.status_code == status and e.value.item == 2
    return e.value


def test_byte_limits(server):
    small = MediaLimits(max_bytes=1000, allow_private_addresses=True)
    _raises(MediaTooLarge, 413, r"image 2: \d+ bytes exceeds max_bytes=1000", _load, "image", small, data=IMG)
    url = "data:image/png;base64," + base64.b64encode(IMG).decode()
    _raises(MediaTooLarge, 413, "max_bytes=1000", _load, "image", small, url=url)
    _raises(MediaTooLarge, 413, "max_bytes=1000", _load, "image", small, url=f"{server}/img.png")
    _raises(MediaTooLarge, 413, "max_bytes=1000", _load, "image", small, url=f"{server}/stream-forever")


def test_pixel_limits():
    _raises(MediaTooLarge, 413, "max_pixels", _load, "image", data=_png_header(100000, 100000))
    err = _raises(MediaTooLarge, 413, None, _load, "image", data=_png_header(5000, 5000))
    assert str(err) == "image 2: 25000000 pixels (5000x5000) exceeds max_pixels=16777216"
    _raises(MediaTooLarge, 413, "3072 pixels", _load, "image", MediaLimits(max_pixels=3000), data=IMG)


def test_video_and_audio_limits():
    _raises(
        MediaTooLarge, 413, "max_video_frames=3", _load, "video", MediaLimits(max_video_frames=3), data=VID
    )
    _raises(
        MediaTooLarge,
        413,
        "max_video_seconds=1.5",
        _load,
        "video",
        MediaLimits(max_video_seconds=1.5),
        data=VID,
    )
    _raises(
        MediaTooLarge,
        413,
        "max_video_pixels_per_frame=1000",
        _load,
        "video",
        MediaLimits(max_video_pixels_per_frame=1000),
        data=VID,
    )
    _raises(
        MediaTooLarge,
        413,
        "1.50 s of audio exceeds max_audio_seconds=1.0",
        _load,
        "audio",
        MediaLimits(max_audio_seconds=1.0),
        data=WAV,
    )


def test_bad_formats():
    _raises(UnsupportedMediaType, 415, "image 2: not", _load, "image", data=b"hello world")
    _raises(MediaDecodeError, 422, "does not decode", _load, "image", data=IMG[: len(IMG) // 2])
    _raises(UnsupportedMediaType, 415, "video", _load, "video", data=b"\x00" * 64)
    err = _raises(MediaError, 400, "base64", _load, "image", url="data:image/png;base64,@@@")
    assert err.code == "invalid_media_input"


def test_fetch_timeout(server):
    limits = MediaLimits(allow_private_addresses=True, fetch_timeout_s=0.5)
    err = _raises(
        MediaFetchTimeout, 408, "fetch_timeout_s=0.5", _load, "image", limits, url=f"{server}/stall"
    )
    assert err.code == "media_fetch_timeout"


def test_redirect_rechecked_per_hop(server):
    # allow-list holds only the loopback server; the redirect target is refused BEFORE any connection
    limits = MediaLimits(allow_private_addresses=True, allowed_domains=("127.0.0.1",))
    assert _load("image", limits, url=f"{server}/redirect?to=/img.png").metadata["source"] == "http"
    _raises(
        URLNotAllowed,
        403,
        "not in allowed_domains",
        _load,
        "image",
        limits,
        url=f"{server}/redirect?to=http://media.example.invalid/x.png",
    )
    # without allow_private_addresses the loopback server itself is refused
    err = _raises(URLNotAllowed, 403, "not allowed", _load, "image", MediaLimits(), url=f"{server}/img.png")
    assert "127.0.0.1" not in err.message.split("host", 1)[1].split("is not allowed", 1)[1]


def test_a_large_data_url_is_decoded_off_the_event_loop_with_the_same_bytes_and_errors(monkeypatch):
    import asyncio

    from encoder_service.preprocess.media import fetch

    monkeypatch.setattr(fetch, "THREAD_DECODE_CHARS", 512 * 1024)  # 8 MiB by default: a smaller body does
    big = make_image_bytes(600, 400, seed=3)  # a noisy PNG: well past that threshold as base64
    url = "data:image/png;base64," + base64.b64encode(big).decode()
    assert len(url) > fetch.THREAD_DECODE_CHARS
    threads = []
    decode = fetch.decode_data_url

    def spy(*args, **kwargs):
        threads.append(threading.current_thread() is threading.main_thread())
        return decode(*args, **kwargs)

    monkeypatch.setattr(fetch, "decode_data_url", spy)
    got = asyncio.run(fetch.fetch_media_bytes(MediaRef("image", url=url), LOOP, item=0))
    assert got.data == big and threads == [False]
    small = MediaLimits(max_bytes=1000)
    with pytest.raises(MediaTooLarge, match="image 0"):
        asyncio.run(fetch.fetch_media_bytes(MediaRef("image", url=url), small, item=0))
    short = "data:image/png;base64," + base64.b64encode(IMG).decode()
    asyncio.run(fetch.fetch_media_bytes(MediaRef("image", url=short), LOOP, item=0))
    assert threads == [False, False, True], "a short one is decoded inline"
