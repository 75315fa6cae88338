"""``load_media``: one client media reference → original bytes (for mm_hash) → decoded value.

Fetching and decoding are separate steps because an item the encoder cache already holds is hashed
but never decoded.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx

from encoder_service.preprocess.errors import InvalidMediaInput, decoding
from encoder_service.preprocess.media.audio import decode_audio
from encoder_service.preprocess.media.decoded import MediaMetadata, MediaValue
from encoder_service.preprocess.media.fetch import FetchedMedia, fetch_media_bytes
from encoder_service.preprocess.media.image import decode_image
from encoder_service.preprocess.media.limits import MediaLimits
from encoder_service.preprocess.media.url_safety import Resolver, resolve_host
from encoder_service.preprocess.media.video import decode_video
from encoder_service.types import MediaRef, Modality


@dataclass
class LoadedMedia:
    """``value``: RGB ``PIL.Image`` (image), ``uint8 [T,H,W,3]`` (video), ``float32 [samples]`` (audio)."""

    modality: Modality
    data: bytes
    value: MediaValue
    metadata: MediaMetadata = field(default_factory=MediaMetadata)


def decode_media(
    modality: Modality,
    fetched: FetchedMedia,
    limits: MediaLimits,
    *,
    item: int | None = None,
    sampling_rate: int = 16000,
    frame_multiple: int = 1,
    max_frame_pixels: int | None = None,
) -> LoadedMedia:
    """Decode already-fetched bytes, enforcing the modality's limits.

    ``max_frame_pixels`` (video): scale frames down to about that many pixels while decoding (the
    processor's own maximum); None keeps the clip's size.

    This is where every decoder exception on client bytes becomes a 4xx ``MediaError`` naming the item
    (``errors.decoding``): the decoders themselves raise only their limit and format errors.
    """
    label = modality if item is None else f"{modality} {item}"
    meta: MediaMetadata
    value: MediaValue
    with decoding(label, item):
        if modality == "image":
            value, meta = decode_image(fetched.data, limits, item=item, label=label)
        elif modality == "video":
            value, meta = decode_video(
                fetched.data,
                limits,
                frame_multiple=frame_multiple,
                item=item,
                label=label,
                max_frame_pixels=max_frame_pixels,
            )
        elif modality == "audio":
            value, meta = decode_audio(fetched.data, limits, sampling_rate, item=item, label=label)
        else:
            raise InvalidMediaInput(f"{label}: unknown modality {modality!r}", item=item)
    meta = {"source": fetched.source, "num_bytes": len(fetched.data), **meta}
    return LoadedMedia(modality, fetched.data, value, meta)


async def load_media(
    ref: MediaRef,
    limits: MediaLimits,
    *,
    item: int | None = None,
    sampling_rate: int = 16000,
    frame_multiple: int = 1,
    client: httpx.AsyncClient | None = None,
    resolver: Resolver = resolve_host,
) -> LoadedMedia:
    """Fetch and decode ``ref``. Decoding runs in a worker thread so an event loop stays responsive."""
    fetched = await fetch_media_bytes(ref, limits, item=item, client=client, resolver=resolver)
    return await asyncio.to_thread(
        decode_media,
        ref.modality,
        fetched,
        limits,
        item=item,
        sampling_rate=sampling_rate,
        frame_multiple=frame_multiple,
    )


def load_media_sync(
    ref: MediaRef,
    limits: MediaLimits,
    *,
    item: int | None = None,
    sampling_rate: int = 16000,
    frame_multiple: int = 1,
    client: httpx.AsyncClient | None = None,
    resolver: Resolver = resolve_host,
) -> LoadedMedia:
    """``load_media`` for callers without an event loop."""
    return asyncio.run(
        load_media(
            ref,
            limits,
            item=item,
            sampling_rate=sampling_rate,
            frame_multiple=frame_multiple,
            client=client,
            resolver=resolver,
        )
    )
