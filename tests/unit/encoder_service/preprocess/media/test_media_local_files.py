"""``file://`` media (issue 11, items 3 and 9): regular files only, read off the event loop, bad paths 4xx.

A FIFO under the allowed root used to block the reading thread (the event loop's) forever. Each FIFO
test runs the read in a helper thread with a deadline and, if it hangs, opens the FIFO's write end
itself so the thread ends, then fails: the test can never hang.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import pytest

from encoder_service.preprocess.errors import InvalidMediaInput, MediaError, MediaTooLarge, URLNotAllowed
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.media.fetch import fetch_media_bytes, read_local_file
from encoder_service.types import MediaRef


def _limits(root, **kw):
    return MediaLimits(allowed_local_media_path=str(root), **kw)


def _run_with_deadline(fn, fifo, seconds=5.0):
    box: dict[str, object] = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(seconds)
    if thread.is_alive():  # unblock the reader so no thread is left behind, then fail
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        thread.join(5)
        pytest.fail(f"reading {fifo} blocked for more than {seconds} s")
    return box, time.monotonic() - started


def test_fifo_under_the_root_refused_at_once(tmp_path):
    fifo = tmp_path / "pipe.mp4"
    os.mkfifo(fifo)
    box, took = _run_with_deadline(lambda: read_local_file(f"file://{fifo}", _limits(tmp_path), item=1), fifo)
    err = box.get("error")
    assert isinstance(err, URLNotAllowed), box
    assert err.status_code == 403 and err.item == 1 and "not a regular file" in err.message
    assert took < 1.0


_WATCHED: dict[str, list[int]] = {}


def _audit(event: str, args: tuple) -> None:
    if event == "open" and args and str(args[0]) in _WATCHED:
        _WATCHED[str(args[0])].append(threading.get_ident())


sys.addaudithook(_audit)  # records which thread opens a watched path; cannot be removed, costs little


def test_async_fetch_opens_the_file_off_the_event_loop_thread(tmp_path):
    path = tmp_path / "clip.bin"
    path.write_bytes(b"abc")
    _WATCHED[str(path)] = []

    async def main():
        got = await fetch_media_bytes(MediaRef("video", url=f"file://{path}"), _limits(tmp_path), item=0)
        return got, threading.get_ident()

    try:
        got, loop_thread = asyncio.run(main())
        opened_by = _WATCHED[str(path)]
    finally:
        del _WATCHED[str(path)]
    assert got.data == b"abc" and got.source == "file"
    assert opened_by and loop_thread not in opened_by  # opened and read in a worker thread


def test_fifo_refused_through_the_async_fetch(tmp_path):
    fifo = tmp_path / "pipe.wav"
    os.mkfifo(fifo)

    async def main():
        with pytest.raises(URLNotAllowed, match="not a regular file") as e:
            await fetch_media_bytes(MediaRef("audio", url=f"file://{fifo}"), _limits(tmp_path), item=0)
        return e.value

    box, took = _run_with_deadline(lambda: asyncio.run(main()), fifo)
    assert "error" not in box, box.get("error")
    assert box["result"].status_code == 403 and took < 1.0


def test_directory_and_device_refused(tmp_path):
    (tmp_path / "sub").mkdir()
    with pytest.raises(URLNotAllowed, match="not a regular file"):
        read_local_file(f"file://{tmp_path}/sub", _limits(tmp_path))
    with pytest.raises(URLNotAllowed, match="not a regular file"):
        read_local_file("file:///dev/zero", _limits("/dev"))


@pytest.mark.parametrize(
    "path",
    ["{root}/a%00.png", "{root}/a.png%00.jpg", "/%00", "{root}/%00/../a.png"],
)
def test_nul_byte_in_path_is_400(tmp_path, path):
    (tmp_path / "a.png").write_bytes(b"x")
    url = "file://" + path.format(root=tmp_path)
    with pytest.raises(InvalidMediaInput, match="NUL byte") as e:
        read_local_file(url, _limits(tmp_path), item=2)
    assert e.value.status_code == 400 and e.value.item == 2


def test_relative_paths_and_escapes_refused(tmp_path, monkeypatch):
    root = tmp_path / "root"
    root.mkdir()
    (root / "ok.bin").write_bytes(b"ok")
    (tmp_path / "secret").write_bytes(b"s")
    monkeypatch.chdir(root)
    with pytest.raises(InvalidMediaInput, match="absolute path"):
        read_local_file("file:ok.bin", _limits(root))
    with pytest.raises(URLNotAllowed, match="outside"):
        read_local_file(f"file://{root}/../secret", _limits(root))
    os.symlink(tmp_path / "secret", root / "link")
    with pytest.raises(URLNotAllowed, match="outside"):
        read_local_file(f"file://{root}/link", _limits(root))
    assert read_local_file(f"file://{root}/ok.bin", _limits(root)).data == b"ok"


def test_size_checked_from_the_descriptor(tmp_path):
    (tmp_path / "big.bin").write_bytes(b"\0" * 2048)
    with pytest.raises(MediaTooLarge, match="2048 bytes exceeds max_bytes=1024"):
        read_local_file(f"file://{tmp_path}/big.bin", _limits(tmp_path, max_bytes=1024))


def test_missing_file_is_a_media_error_without_the_real_path(tmp_path):
    with pytest.raises(MediaError) as e:
        read_local_file(f"file://{tmp_path}/nope.png", _limits(tmp_path))
    assert 400 <= e.value.status_code < 500 and str(tmp_path) not in e.value.message
