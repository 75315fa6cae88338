"""Which container formats each modality accepts, told from the bytes, and opened from memory only.

FFmpeg, left to guess, recognises hundreds of formats, some of which are playlists that make it open
other URLs: an ``ffconcat`` body reads files next to the server, an ``sdp`` body opens UDP sockets,
``hls`` fetches segments. So the format is never guessed by FFmpeg. It is told here from the leading
bytes (magic numbers) and must be on the modality's allow-list; PyAV then opens the bytes with that
demuxer named explicitly (no probing), from an in-memory buffer, with every nested open refused:

    bytes ──sniff_container──▶ "mp4" | "matroska" | "avi" | "mpegts" | "wav" | "flac" | "mp3" | "ogg"
          └─ anything else ──▶ 415 before FFmpeg sees a byte
    av.open(BytesIO, format=<demuxer>, io_open=<refuse>, options={protocol_whitelist: <none>})
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, NoReturn

from encoder_service.preprocess.errors import UnsupportedMediaType, URLNotAllowed

if TYPE_CHECKING:
    from av.container import InputContainer

VIDEO_CONTAINERS: tuple[str, ...] = ("mp4", "matroska", "avi", "mpegts")
AUDIO_CONTAINERS: tuple[str, ...] = ("wav", "flac", "mp3", "ogg")

# our name → FFmpeg demuxer name
DEMUXERS: dict[str, str] = {
    "mp4": "mov",  # mp4, mov, m4v, 3gp (one demuxer); external data references stay off (enable_drefs=0)
    "matroska": "matroska",  # matroska and webm
    "avi": "avi",
    "mpegts": "mpegts",
    "wav": "wav",
    "flac": "flac",
    "mp3": "mp3",
    "ogg": "ogg",
}

# ISO BMFF top-level boxes a file may start with (ftyp first in practice; QuickTime may start otherwise)
_BMFF_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot")
_TS_PACKET = 188


def _is_mpegts(data: bytes) -> bool:
    """0x47 sync bytes at packet boundaries (188-byte TS, or 192-byte M2TS with a 4-byte prefix)."""
    for size, start in ((_TS_PACKET, 0), (192, 4)):
        marks = range(start, min(len(data), start + 3 * size), size)
        if len(marks) >= 2 and all(data[i] == 0x47 for i in marks):
            return True
    return False


def _is_mp3(data: bytes) -> bool:
    if data[:3] == b"ID3":
        return True
    # MPEG audio frame sync (11 bits), layer bits not "reserved"
    return len(data) >= 2 and data[0] == 0xFF and (data[1] & 0xE0) == 0xE0 and (data[1] & 0x06) != 0


def sniff_container(data: bytes) -> str | None:
    """The container ``data`` starts like, among the formats accepted at all; None when none."""
    head = data[:16]
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    if head[4:8] in _BMFF_BOXES:
        return "mp4"
    if _is_mpegts(data):
        return "mpegts"
    if _is_mp3(data):
        return "mp3"
    return None


def require_container(data: bytes, allowed: tuple[str, ...], kind: str, label: str, item: int | None) -> str:
    """The accepted container ``data`` is in, or 415 naming what the modality accepts."""
    found = sniff_container(data)
    if found not in allowed:
        what = f"a {found} container" if found else "not a recognised container"
        raise UnsupportedMediaType(f"{label}: {what}; {kind} must be one of: {', '.join(allowed)}", item=item)
    return found


# Nested opens take two roads in FFmpeg: ``io_open`` (hls, dash, mov drefs) meets the hook below; a
# demuxer that opens a sub-context itself (concat) meets the protocol whitelist, which names no real
# protocol. Neither road is reachable from the allow-listed demuxers; this is defence in depth.
SAFE_CONTAINER_OPTIONS = {"protocol_whitelist": "memory_only_no_protocol", "enable_drefs": "0"}


def _refuse_nested_open(url: str, flags: int, options: dict[str, str]) -> NoReturn:
    """PyAV's ``io_open`` hook: a demuxer asked to open another URL (playlist, reference). Never."""
    raise URLNotAllowed(f"media tried to open {url!r}; containers may not reference other files or URLs")


def open_container(data: bytes, container: str) -> InputContainer:
    """``av.open`` on the in-memory bytes with the demuxer named; no probing, no nested opens."""
    import av

    return av.open(
        io.BytesIO(data),
        mode="r",
        format=DEMUXERS[container],
        container_options=SAFE_CONTAINER_OPTIONS,
        io_open=_refuse_nested_open,
        metadata_errors="replace",  # a title in another charset is no reason to refuse the media
    )
