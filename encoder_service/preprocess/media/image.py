"""Image bytes → RGB ``PIL.Image``: an allow-list of formats, the pixel limit checked from the header
before any pixel is decoded, and every decoder failure turned into a 4xx naming the item.

    bytes ──open (header only, allowed formats)──▶ size ≤ max_pixels? ──▶ [JPEG: draft at 1/2..1/8
          scale when the processor shrinks at least that much] ──load──▶ RGB

``decode_image`` returns the full-size image (what HF's own processors see); ``decode_image_scaled``
may return a JPEG decoded at reduced scale (libjpeg's DCT scaling), never smaller than ``min_size``,
with the original size kept beside it so the processor's resize target stays the same.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image, JpegImagePlugin, UnidentifiedImageError

from encoder_service.preprocess.errors import (
    MediaDecodeError,
    MediaTooLarge,
    UnsupportedMediaType,
    decoder_error,
    decoding,
)
from encoder_service.preprocess.media.decoded import MediaMetadata
from encoder_service.preprocess.media.limits import MediaLimits

# Pillow guesses among every plugin it has (PPM, IM, SGI, DDS, PSD, EPS, ...); a hostile body picks the
# least-tested one. Only these are opened; GIF and WEBP give their first frame, and a JPEG with more
# pictures (MPO, as some cameras write) its first picture.
ALLOWED_IMAGE_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP")


@dataclass(frozen=True)
class DecodedImage:
    """An RGB image and the size its header declared (``image`` is smaller after a JPEG draft decode)."""

    image: Image.Image
    width: int
    height: int
    format: str | None

    @property
    def reduced(self) -> bool:
        return self.image.size != (self.width, self.height)

    def metadata(self) -> MediaMetadata:
        return {"width": self.width, "height": self.height, "format": self.format}


def image_header(
    data: bytes, limits: MediaLimits, *, item: int | None = None, label: str = "image"
) -> Image.Image:
    """Open lazily (header only) and refuse more than ``max_pixels`` before any pixel is decoded."""
    try:
        img = Image.open(io.BytesIO(data), formats=ALLOWED_IMAGE_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        # PIL's own guard fires in open() for headers far above its default; ours is the stricter one.
        raise MediaTooLarge(
            f"{label}: pixel count exceeds max_pixels={limits.max_pixels} ({e})", item=item
        ) from e
    except UnidentifiedImageError as e:
        raise UnsupportedMediaType(
            f"{label}: not an image in an accepted format ({', '.join(ALLOWED_IMAGE_FORMATS)})", item=item
        ) from e
    except Exception as e:  # a plugin's parser failing on a hostile header: OSError, ValueError, ...
        raise decoder_error(e, label, item) from e
    width, height = img.size
    if width < 1 or height < 1:
        raise MediaDecodeError(f"{label}: image has no pixels ({width}x{height})", item=item)
    if width * height > limits.max_pixels:
        raise MediaTooLarge(
            f"{label}: {width * height} pixels ({width}x{height}) exceeds max_pixels={limits.max_pixels}",
            item=item,
        )
    return img


def decode_image_scaled(
    data: bytes,
    limits: MediaLimits,
    *,
    min_size: tuple[int, int] | None = None,
    item: int | None = None,
    label: str = "image",
) -> DecodedImage:
    """Decode to RGB; a JPEG is decoded at 1/2, 1/4 or 1/8 scale when that still gives ≥ ``min_size``
    (width, height) pixels. ``None`` decodes at full size."""
    header = image_header(data, limits, item=item, label=label)
    return decode_opened(header, min_size=min_size, item=item, label=label)


def decode_opened(
    img: Image.Image,
    *,
    min_size: tuple[int, int] | None = None,
    item: int | None = None,
    label: str = "image",
) -> DecodedImage:
    """``decode_image_scaled`` for an image ``image_header`` already opened (and checked); call once."""
    width, height = img.size
    fmt = img.format
    with decoding(label, item):  # the one mapping of a decoder's exceptions to a 4xx (errors.py)
        if min_size is not None and isinstance(img, JpegImagePlugin.JpegImageFile):  # JPEG and MPO
            img.draft(None, min_size)  # picks the largest DCT scale whose output is still ≥ min_size
        img.load()
        rgb = img if img.mode == "RGB" else img.convert("RGB")
    return DecodedImage(rgb, width, height, fmt)


def decode_image(
    data: bytes, limits: MediaLimits, *, item: int | None = None, label: str = "image"
) -> tuple[Image.Image, MediaMetadata]:
    """Full-size RGB image and its metadata (width, height, format)."""
    decoded = decode_image_scaled(data, limits, item=item, label=label)
    return decoded.image, decoded.metadata()
