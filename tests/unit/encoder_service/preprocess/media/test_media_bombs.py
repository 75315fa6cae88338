"""Decompression bombs (issue 11, item 5): decoded-size budgets enforced while decoding.

Audio: samples = rate x channels x seconds, counted as blocks decode (the header may hide the length);
memory stays at the mono output. Video: each decoded frame's size is checked, pixels are summed over
every decoded frame, and a stream that switches resolution is scaled to one size as it decodes.
Peak memory is measured in a fresh interpreter (``VmHWM``) where the decoder's own C allocations
matter, and with ``tracemalloc`` (numpy's buffers are traced) elsewhere.
"""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
import tracemalloc

import librosa
import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from encoder_service.preprocess.errors import MediaTooLarge
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.media.fetch import FetchedMedia
from encoder_service.preprocess.media.loader import decode_media
from tests.media import make_video_bytes
from tests.unit.encoder_service.preprocess.media.test_media_samples import encode_video, flac_bomb


def _decode(modality, data, limits):
    return decode_media(modality, FetchedMedia(data, "bytes"), limits, item=4)


def _traced_peak(fn):
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


# ---- audio -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hide_length", [False, True])
def test_high_rate_multichannel_flac_refused_with_small_peak(hide_length):
    data = flac_bomb(hide_length=hide_length)  # 29 s: under max_audio_seconds=30, but 152 M samples

    def run():
        with pytest.raises(MediaTooLarge, match=r"^audio 4: .* decoded samples .* exceed") as e:
            _decode("audio", data, MediaLimits())
        assert e.value.status_code == 413 and e.value.item == 4

    assert _traced_peak(run) < 16 * 2**20  # the old decoder held ~600 MB of float32 samples


def _rss_growth_mb(data: bytes, modality: str, limits: str, tmp_path) -> int:
    """Decode ``data`` in a fresh interpreter that only reads it from a file (making it would raise the
    peak first); the growth of its peak RSS in MB while decoding. The decode must be refused."""
    path = tmp_path / "item.bin"
    path.write_bytes(data)
    script = textwrap.dedent(
        f"""
        import sys
        from encoder_service.preprocess.errors import MediaTooLarge
        from encoder_service.preprocess.media import MediaLimits
        from encoder_service.preprocess.media.fetch import FetchedMedia
        from encoder_service.preprocess.media.loader import decode_media
        import av, soundfile, soxr  # loaded before the baseline, as in a serving process
        def peak_kb():  # VmHWM: this process image's peak RSS (ru_maxrss carries the parent's over exec)
            line = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:")][0]
            return int(line.split()[1])
        data = open({str(path)!r}, "rb").read()
        before = peak_kb()
        try:
            decode_media("{modality}", FetchedMedia(data, "bytes"), {limits}, item=0)
        except MediaTooLarge:
            pass
        else:
            sys.exit("not refused")
        print((peak_kb() - before) // 1024)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


def test_flac_bomb_rss_stays_bounded_in_a_fresh_process(tmp_path):
    growth = _rss_growth_mb(flac_bomb(hide_length=True), "audio", "MediaLimits()", tmp_path)
    assert growth < 64  # was ~700 MB


@pytest.mark.slow
def test_4k_switch_rss_stays_bounded_in_a_fresh_process(tmp_path):
    # FFmpeg's own max_pixels refuses the 4K picture before its buffers exist
    data = encode_video([(64, 64, 4), (3840, 2160, 8)])
    assert _rss_growth_mb(data, "video", "MediaLimits(video_num_frames=12)", tmp_path) < 48  # 109 unlimited


def test_budget_is_rate_times_channels_times_seconds():
    limits = MediaLimits(max_audio_seconds=2.0, max_audio_samples_per_second=48_000 * 2)
    rng = np.random.default_rng(0)

    def wav(rate, channels, seconds):
        buf = io.BytesIO()
        sf.write(buf, rng.uniform(-0.2, 0.2, (int(rate * seconds), channels)), rate, format="WAV")
        return buf.getvalue()

    assert _decode("audio", wav(48_000, 2, 1.9), limits).value.shape == (30_400,)  # 182,400 samples: fits
    with pytest.raises(MediaTooLarge, match="decoded samples"):
        _decode("audio", wav(48_000, 4, 1.9), limits)  # same seconds, twice the channels
    with pytest.raises(MediaTooLarge, match="decoded samples"):
        _decode("audio", wav(192_000, 1, 1.1), limits)  # 211 k samples in 1.1 s
    with pytest.raises(MediaTooLarge, match="max_audio_seconds"):
        _decode("audio", wav(8_000, 1, 2.5), limits)


@pytest.mark.parametrize(("rate", "channels"), [(44_100, 2), (48_000, 6), (8_000, 1), (96_000, 2)])
def test_streamed_downmix_and_resample_equal_librosa(rate, channels):
    rng = np.random.default_rng(rate + channels)
    samples = rng.uniform(-0.5, 0.5, (int(rate * 2.3), channels)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="FLAC", subtype="PCM_24")
    got = _decode("audio", buf.getvalue(), MediaLimits())
    decoded, _ = sf.read(io.BytesIO(buf.getvalue()), dtype="float32", always_2d=True)
    ref = librosa.resample(decoded.mean(axis=1), orig_sr=rate, target_sr=16_000)  # the one-shot way
    assert got.value.shape == ref.shape
    np.testing.assert_allclose(got.value, ref, atol=1e-6)


# ---- video -------------------------------------------------------------------------------------------


def test_resolution_switch_to_4k_refused_while_decoding():
    data = encode_video([(64, 64, 4), (3840, 2160, 4)])  # the header says 64x64

    def run():
        with pytest.raises(MediaTooLarge, match=r"^video 4: 3840x2160 = 8294400 pixels per frame") as e:
            _decode("video", data, MediaLimits(video_num_frames=8))
        assert e.value.status_code == 413

    assert _traced_peak(run) < 32 * 2**20


def test_resolution_switch_within_limits_is_scaled_to_one_size():
    data = encode_video([(64, 64, 4), (96, 48, 4)])
    got = _decode("video", data, MediaLimits(video_num_frames=8))
    frames = got.value
    assert frames.shape == (8, 64, 64, 3) and got.metadata["width"] == 64  # one array: no np.stack crash
    # flat greys 10 + 20 i: the picks from the 96x48 half are scaled, not cropped, so they stay flat
    greys = frames.reshape(8, -1).astype(int)
    assert (greys.max(axis=1) - greys.min(axis=1)).max() <= 2
    assert (greys.mean(axis=1) > 80).sum() >= 2  # picks from the second half (greys 90+) are there


def test_decoded_pixels_summed_over_every_decoded_frame():
    data = encode_video([(64, 48, 12)])
    per_frame = 64 * 48
    # 12 frames decoded, only 2 sampled: the budget counts all 12
    limits = MediaLimits(video_num_frames=2, max_video_decoded_pixels=per_frame * 12)
    assert _decode("video", data, limits).value.shape == (2, 48, 64, 3)
    with pytest.raises(MediaTooLarge, match="max_video_decoded_pixels"):
        _decode("video", data, MediaLimits(video_num_frames=2, max_video_decoded_pixels=per_frame * 11))


def test_header_frame_size_still_checked_first():
    data = encode_video([(640, 480, 2)])
    with pytest.raises(MediaTooLarge, match="640x480"):
        _decode("video", data, MediaLimits(max_video_pixels_per_frame=320 * 240))


def test_frames_scaled_to_what_the_processor_keeps_while_decoding():
    data = make_video_bytes(320, 240, num_frames=4, fps=4)
    limits = MediaLimits(video_num_frames=4)
    full = _decode("video", data, limits).value
    small = decode_media("video", FetchedMedia(data, "bytes"), limits, item=4, max_frame_pixels=160 * 120)
    assert small.value.shape == (4, 120, 160, 3) and small.metadata["width"] == 160
    # independent reference: PIL's box filter on the full-size frames
    ref = np.stack([np.asarray(Image.fromarray(f).resize((160, 120), Image.BOX)) for f in full])
    assert np.abs(ref.astype(int) - small.value).mean() < 1.0
    unchanged = decode_media("video", FetchedMedia(data, "bytes"), limits, item=4, max_frame_pixels=320 * 240)
    assert np.array_equal(unchanged.value, full)


def test_many_channels_read_in_small_blocks():
    # 1,024 channels of u8 PCM: each sample read becomes 4 bytes of float32; the block is sized in
    # samples, so the traced peak stays near the input and the output, not 4x the input per block
    buf = io.BytesIO()
    sf.write(buf, np.zeros((2000, 1024), np.float32), 8000, format="WAV", subtype="PCM_U8")
    data = buf.getvalue()

    def run():
        got = _decode("audio", data, MediaLimits())
        assert got.value.shape == (4000,) and np.abs(got.value).max() < 1e-2

    assert _traced_peak(run) < 4 * 2**20  # the u8 input alone is 2 MB; float32 of it all is 8 MB
