"""Target: image bytes -> RGB, as the preprocessor decodes them: ``image_header`` (format allow-list,
``max_pixels`` from the header) then ``decode_opened`` (at full size, or a JPEG at reduced DCT scale
for odd-length inputs). Expected: an RGB image within the limits, or a ``MediaError``."""

from __future__ import annotations

from cluster.bench.fuzz.outcomes import check_cause
from encoder_service.preprocess.errors import MediaError
from encoder_service.preprocess.media.image import decode_opened, image_header
from encoder_service.preprocess.media.limits import MediaLimits

LIMITS = MediaLimits(max_pixels=256 * 256)  # small, so that a mutated header reaches the check


def one_input(data: bytes) -> None:
    min_size = (24, 24) if len(data) % 2 else None
    try:
        header = image_header(data, LIMITS, item=0, label="image 0")
        decoded = decode_opened(header, min_size=min_size, item=0, label="image 0")
    except MediaError as e:
        check_cause(e)
        return
    w, h = decoded.image.size
    if (
        decoded.image.mode != "RGB"
        or w * h > LIMITS.max_pixels
        or decoded.width * decoded.height > LIMITS.max_pixels
    ):
        raise AssertionError(f"decoded {decoded.image.mode} {w}x{h} past max_pixels={LIMITS.max_pixels}")
