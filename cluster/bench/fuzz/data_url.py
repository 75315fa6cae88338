"""Target: a media part's ``data:`` URL (any text a JSON string can hold, lone surrogates included)
-> its bytes, through ``inline_media_bytes`` as the preprocessor takes it. Expected: bytes within
``max_bytes``, None (not a data URL), or a ``MediaError`` (400 malformed, 413 too large)."""

from __future__ import annotations

from cluster.bench.fuzz.outcomes import check_cause
from encoder_service.preprocess.errors import MediaError
from encoder_service.preprocess.media.fetch import decode_data_url, inline_media_bytes
from encoder_service.preprocess.media.limits import MediaLimits
from encoder_service.types import MODALITIES, MediaRef

LIMITS = MediaLimits(max_bytes=2048)  # small, so that the size checks are reached


def one_input(data: bytes) -> None:
    modality = MODALITIES[data[0] % len(MODALITIES)] if data else "image"
    url = data[1:].decode("utf-8", "surrogateescape")  # undecodable bytes become lone surrogates
    try:
        fetched = inline_media_bytes(MediaRef(modality, url=url), LIMITS, item=0)
        if fetched is None and url[:5].lower() == "data:":  # past THREAD_DECODE_CHARS: a worker thread
            fetched = decode_data_url(url, LIMITS, item=0)
    except MediaError as e:
        check_cause(e)
        return
    if fetched is not None and len(fetched.data) > LIMITS.max_bytes:
        raise AssertionError(f"{len(fetched.data)} bytes passed max_bytes={LIMITS.max_bytes}")
