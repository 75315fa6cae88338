"""Container allow-list (issue 11, item 4): FFmpeg never guesses the format, nothing opens files or sockets.

Every file here is generated in the test. The SDP and HLS bodies are refused before PyAV is called at
all: ``av.open`` is replaced by a tripwire for those tests, so a regression fails loudly instead of
opening a socket.
"""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from encoder_service.preprocess.errors import MediaError, UnsupportedMediaType
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.media.containers import SAFE_CONTAINER_OPTIONS, sniff_container
from encoder_service.preprocess.media.fetch import FetchedMedia
from encoder_service.preprocess.media.loader import decode_media
from tests.media import make_audio_bytes, make_video_bytes
from tests.unit.encoder_service.preprocess.media.test_media_samples import encode_audio, encode_video

LIMITS = MediaLimits(video_num_frames=4)


def _decode(modality, data, limits=LIMITS):
    return decode_media(modality, FetchedMedia(data, "bytes"), limits, item=1)


@pytest.fixture
def no_demuxing(monkeypatch):
    def tripwire(*args, **kwargs):
        raise AssertionError("av.open was called: the body reached FFmpeg")

    monkeypatch.setattr(av, "open", tripwire)


def test_ffconcat_body_cannot_read_server_files(tmp_path, monkeypatch):
    # a real clip next to the server's working directory, and a real ffconcat body naming it
    (tmp_path / "clip.mp4").write_bytes(make_video_bytes(64, 48, num_frames=8, fps=4))
    monkeypatch.chdir(tmp_path)
    body = b"ffconcat version 1.0\nfile 'clip.mp4'\n"
    with av.open(io.BytesIO(body)) as probed:  # FFmpeg left to guess does read it: the attack is real
        assert probed.format.name == "concat" and len(list(probed.decode(video=0))) == 8
    with pytest.raises(UnsupportedMediaType, match=r"^video 1: not a recognised container") as e:
        _decode("video", body)
    assert e.value.status_code == 415 and e.value.item == 1 and "mp4" in e.value.message


def test_nested_opens_refused_even_if_a_playlist_demuxer_were_reached(tmp_path, monkeypatch):
    (tmp_path / "clip.mp4").write_bytes(make_video_bytes(64, 48, num_frames=4, fps=4))
    monkeypatch.chdir(tmp_path)
    body = b"ffconcat version 1.0\nfile 'clip.mp4'\n"
    opts = SAFE_CONTAINER_OPTIONS
    with (  # the protocol whitelist names no real protocol
        pytest.raises(av.error.FFmpegError),
        av.open(io.BytesIO(body), format="concat", container_options=opts) as c,
    ):
        list(c.decode(video=0))


@pytest.mark.usefixtures("no_demuxing")
@pytest.mark.parametrize("modality", ["video", "audio"])
def test_sdp_refused_before_demuxing(modality):
    # 106 bytes of SDP made FFmpeg bind a UDP socket on the port it names and wait for RTP
    sdp = (
        b"v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=x\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
        b"m=video 45678 RTP/AVP 96\r\na=rtpmap:96 H264/90000\r\n"
    )
    assert sniff_container(sdp) is None
    with pytest.raises(UnsupportedMediaType) as e:
        _decode(modality, sdp)
    assert e.value.status_code == 415 and e.value.message.startswith(f"{modality} 1: not a recognised")


@pytest.mark.usefixtures("no_demuxing")
@pytest.mark.parametrize(
    "body",
    [
        b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nhttp://127.0.0.1:9/seg.ts\n#EXT-X-ENDLIST\n",
        b"<?xml version='1.0'?><MPD xmlns='urn:mpeg:dash:schema:mpd:2011'></MPD>",
        b"ffconcat version 1.0\nfile 'subfile,,start,0,end,100,,:/etc/passwd'\n",
        b"\x00" * 64,
        b"",
    ],
)
def test_playlists_and_unknown_bodies_refused_before_demuxing(body):
    for modality in ("video", "audio"):
        with pytest.raises(UnsupportedMediaType):
            _decode(modality, body)


@pytest.mark.parametrize(
    ("container", "codec", "expected"),
    [
        ("mp4", "libx264", "mp4"),
        ("mov", "libx264", "mp4"),
        ("webm", "libvpx-vp9", "matroska"),
        ("matroska", "libx264", "matroska"),
        ("avi", "mpeg4", "avi"),
        ("mpegts", "libx264", "mpegts"),
    ],
)
def test_every_allowed_video_container_decodes(container, codec, expected):
    data = encode_video([(64, 48, 8)], container=container, codec=codec)
    assert sniff_container(data) == expected
    got = _decode("video", data)
    assert got.value.shape == (4, 48, 64, 3) and got.value.dtype == np.uint8
    # each frame is a flat grey of 10 + 20 * i: the decoded picks are those greys (lossy, so within 3)
    assert np.abs(got.value.astype(int).mean(axis=(1, 2, 3)) - [10, 50, 110, 150]).max() < 3


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "MP3", "OGG"])
def test_every_allowed_audio_container_decodes(fmt):
    data = make_audio_bytes(1.0, sr=16000, fmt=fmt)
    assert sniff_container(data) == {"WAV": "wav", "FLAC": "flac", "MP3": "mp3", "OGG": "ogg"}[fmt]
    got = _decode("audio", data)
    assert abs(got.value.shape[0] - 16000) <= 1152 and got.metadata["format"] == fmt  # mp3 pads a frame


def test_ogg_opus_goes_through_pyav_with_the_ogg_demuxer():
    data, signal = encode_audio("ogg", "libopus", rate=48000, seconds=1 / 3)  # libsndfile refuses it
    got = _decode("audio", data)
    assert got.metadata["format"] == "ogg" and got.metadata["orig_sampling_rate"] == 48000
    ref = signal[::3]  # the 440 Hz sine sampled at 16 kHz: what resampling must give back
    lag = int(np.argmax(np.correlate(got.value[:4000], ref[:2000], mode="valid")))  # opus pre-skip
    n = min(len(ref), len(got.value) - lag) - 100
    assert np.corrcoef(got.value[lag : lag + n], ref[:n])[0, 1] > 0.99


@pytest.mark.parametrize(
    ("modality", "data"),
    [
        ("video", make_audio_bytes(0.5, fmt="WAV")),
        ("video", make_audio_bytes(0.5, fmt="FLAC")),
        ("audio", make_video_bytes(64, 48, num_frames=2, fps=2)),
        ("audio", make_video_bytes(64, 48, num_frames=2, fps=2, container="webm")),
    ],
)
def test_a_container_of_the_other_modality_is_415(modality, data):
    with pytest.raises(UnsupportedMediaType, match=f"^{modality} 1: a .* container; {modality} must be"):
        _decode(modality, data)


def test_non_utf8_metadata_does_not_refuse_the_clip():
    data = encode_video([(64, 48, 4)], container="matroska", codec="libx264", title=b"\xff\xfe\xfd\xfc")
    got = _decode("video", data)  # PyAV's strict metadata decoding raised UnicodeDecodeError (a 500)
    assert got.value.shape[0] == 4


def test_wav_holding_another_codec_still_decodes_or_is_a_media_error():
    for codec in ("pcm_alaw", "adpcm_ms", "pcm_u8"):
        data, signal = encode_audio("wav", codec, rate=16000, seconds=0.5)
        try:
            got = _decode("audio", data)
        except MediaError as e:
            assert 400 <= e.status_code < 500
            continue
        assert np.corrcoef(got.value[: len(signal)], signal[: len(got.value)])[0, 1] > 0.95


def test_sniffing_needs_the_real_signature():
    assert sniff_container(b"GIF89a" + b"\0" * 100) is None  # one 0x47 byte is not MPEG-TS
    assert sniff_container(b"RIFF\0\0\0\0WAVE") == "wav" and sniff_container(b"RIFF\0\0\0\0AVI ") == "avi"
    assert sniff_container(b"RIFF\0\0\0\0WEBP") is None
    assert sniff_container(b"\0\0\0\x18ftypisom") == "mp4" and sniff_container(b"\0\0\0\x18ftyp"[:6]) is None
    ts = bytearray(188 * 3)
    ts[0] = ts[188] = ts[376] = 0x47
    assert sniff_container(bytes(ts)) == "mpegts" and sniff_container(bytes(ts[:100])) is None
    assert sniff_container(b"ID3\x04\0\0") == "mp3" and sniff_container(b"\xff\xfb\x90\x64") == "mp3"
    assert sniff_container(b"\xff\xe0\0\0") is None  # frame sync with the reserved layer bits
