"""Media loading: every form a client sends (bytes, data URL, http(s) URL, file URL), limits, URL safety."""

from __future__ import annotations

from encoder_service.preprocess.media.fetch import FetchedMedia, fetch_media_bytes
from encoder_service.preprocess.media.limits import MediaLimits
from encoder_service.preprocess.media.loader import LoadedMedia, decode_media, load_media, load_media_sync
from encoder_service.preprocess.media.pinned_client import PinnedClient
from encoder_service.preprocess.media.url_safety import (
    address_refusal,
    check_addresses,
    check_url,
    resolve_local_path,
)

__all__ = [
    "FetchedMedia",
    "LoadedMedia",
    "MediaLimits",
    "PinnedClient",
    "address_refusal",
    "check_addresses",
    "check_url",
    "decode_media",
    "fetch_media_bytes",
    "load_media",
    "load_media_sync",
    "resolve_local_path",
]
