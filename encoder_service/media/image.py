"""Image bytes → RGB ``PIL.Image``, with the pixel limit checked from the header before decoding."""

from __future__ import annotations

import io
import warnings
from typing import Any

from PIL import Image, UnidentifiedImageError

from encoder_service.errors import MediaDecodeError, MediaTooLarge, UnsupportedMediaType
from encoder_service.media.limits import MediaLimits


def image_header(
    data: bytes, limits: MediaLimits, *, item: int | None = None, label: str = "image"
) -> Image.Image:
    """Open lazily (header only) and refuse more than ``max_pixels`` before any pixel is decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        # PIL's own guard fires in open() for headers far above its default; ours is the stricter one.
        raise MediaTooLarge(
            f"{label}: pixel count exceeds max_pixels={limits.max_pixels} ({e})", item=item
        ) from e
    except UnidentifiedImageError as e:
        raise UnsupportedMediaType(f"{label}: not a recognised image format", item=item) from e
    width, height = img.size
    if width * height > limits.max_pixels:
        raise MediaTooLarge(
            f"{label}: {width * height} pixels ({width}x{height}) exceeds max_pixels={limits.max_pixels}",
            item=item,
        )
    return img


def decode_image(
    data: bytes, limits: MediaLimits, *, item: int | None = None, label: str = "image"
) -> tuple[Image.Image, dict[str, Any]]:
    img = image_header(data, limits, item=item, label=label)
    fmt = img.format
    try:
        img.load()
        rgb = img.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:
        raise MediaDecodeError(f"{label}: image data does not decode ({e})", item=item) from e
    return rgb, {"width": rgb.width, "height": rgb.height, "format": fmt}
