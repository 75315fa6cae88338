"""Errors for bad client input on the encoder side, each with the HTTP status and code the router maps.

Every error names the item it is about (``item`` is the item's index among the request's media items,
``None`` when the error concerns the request as a whole), so a client can tell which part to fix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class MediaError(Exception):
    """Root of all client-facing media errors. ``status_code`` and ``code`` feed an OpenAI-style error."""

    status_code: int = 400
    code: str = "invalid_media"

    def __init__(self, message: str, *, item: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.item = item

    def to_dict(self) -> dict[str, object]:
        """The OpenAI error body: ``{"message", "type", "code", "param"}``."""
        return {
            "message": self.message,
            "type": "invalid_request_error",
            "code": self.code,
            "param": None if self.item is None else f"media[{self.item}]",
        }


class InvalidMediaInput(MediaError):
    """Malformed reference: bad data URL, bad base64, unknown URL scheme, neither data nor url."""

    status_code = 400
    code = "invalid_media_input"


class MediaTooLarge(MediaError):
    """Bytes, pixels, frames, duration or seconds over a configured limit."""

    status_code = 413
    code = "media_too_large"


class UnsupportedMediaType(MediaError):
    status_code = 415
    code = "unsupported_media_type"


class MediaDecodeError(MediaError):
    """Bytes of a known kind that do not decode (truncated, corrupt)."""

    status_code = 422
    code = "media_decode_error"


class URLNotAllowed(MediaError):
    """A URL or local path refused by the SSRF / allow-list / local-path rules."""

    status_code = 403
    code = "url_not_allowed"


class MediaFetchTimeout(MediaError):
    status_code = 408
    code = "media_fetch_timeout"


class MediaFetchError(MediaError):
    """The remote server answered with an error status, too many redirects, or the connection failed."""

    status_code = 400
    code = "media_fetch_failed"


class MMCacheMiss(MediaError):
    """The item was sent as a ``uuid`` only and the encoder cache does not hold it: resend the bytes."""

    status_code = 400
    code = "mm_cache_miss"


class TooManyItems(MediaError):
    """More items of one modality than ``limit_mm_per_prompt`` allows, or a modality the model lacks."""

    status_code = 400
    code = "too_many_items"


class ToolsUnsupported(ValueError):
    """A request with ``tools`` for a processor whose chat template never reads them: a 400 naming
    ``tools`` (the router maps a ValueError's ``code`` and ``param``), not a silent drop."""

    code = "tools_unsupported"
    param = "tools"


class EncoderCacheFull(MediaError):
    """An item larger than an encoder-cache shard can hold."""

    status_code = 400
    code = "encoder_cache_full"


def item_name(modality: str, item: int | None) -> str:
    """``"image 2"`` — how messages name an item."""
    return modality if item is None else f"{modality} {item}"


class EncoderCacheBusy(MediaError):
    """Another request's computation of the same item did not commit within the wait: retry later."""

    status_code = 503
    code = "encoder_cache_busy"


# Third-party decoders given hostile bytes raise whatever their parser hits: av.error.*, OSError,
# ValueError, AttributeError, UnicodeDecodeError, struct.error, soundfile.LibsndfileError, librosa's
# ParameterError, PIL's UnidentifiedImageError, ... These say "the format is not one we read" (415):
_UNSUPPORTED_NAMES = frozenset({"UnidentifiedImageError", "PatchWelcomeError", "NotImplementedError"})


def decoder_error(exc: BaseException, label: str, item: int | None) -> MediaError:
    """THE mapping of a decoder's or processor's exception on client bytes to a 4xx naming the item.

    Our own ``MediaError`` passes through; ``MemoryError`` → 413; a format the decoder does not
    implement → 415; anything else a decoder raises on the bytes → 422.
    """
    if isinstance(exc, MediaError):
        return exc
    if isinstance(exc, MemoryError):
        return MediaTooLarge(f"{label}: decoding needs more memory than this server allows", item=item)
    kind = type(exc).__name__
    if kind in _UNSUPPORTED_NAMES or isinstance(exc, NotImplementedError):
        return UnsupportedMediaType(f"{label}: format or codec not supported ({kind}: {exc})", item=item)
    return MediaDecodeError(f"{label}: media data does not decode ({kind}: {exc})", item=item)


@contextmanager
def decoding(label: str, item: int | None) -> Iterator[None]:
    """``with decoding("video 2", 2): ...`` — every exception inside becomes ``decoder_error(...)``.

    Only ``Exception`` is mapped (KeyboardInterrupt, SystemExit, cancellation pass through). The
    original traceback is logged at DEBUG so a decoder bug stays findable.
    """
    try:
        yield
    except MediaError:
        raise
    except Exception as e:
        log.debug("%s: decoder raised", label, exc_info=True)
        raise decoder_error(e, label, item) from e


def processed_or_422(process: Callable[[], T], modality: str, index: int) -> T:
    """HF processors refuse data they cannot take (sizes, aspect ratios, channels) with ``ValueError``:
    the client's 422 naming the item. Decoders' exceptions are mapped where they decode
    (``decoding``); anything else a processor raises is our bug and stays a 500."""
    try:
        return process()
    except ValueError as e:
        raise MediaDecodeError(
            f"{modality} {index}: the processor refused it ({str(e)[:200]})", item=index
        ) from e
