"""A request's media items: the record the preprocessor fills per item, and ``collect_media``, which
finds the media parts of a chat in prompt order (their index is the item index), checks each
modality's ``limit_mm_per_prompt``, and gives the messages the chat template sees. Pure: no torch,
no I/O.

Each payload is decoded once: an item keeps the content part it came from, and once its data URL is
decoded (``MediaItem.keep_bytes``) the part carries the bytes instead, so whoever reads the same
messages next (the encoder replica the ingress's hit path hands a miss to, a retry) takes them as
they are: no second base64 decode, and a quarter less to send.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from PIL import Image

from encoder_service.preprocess.errors import InvalidMediaInput, TooManyItems
from encoder_service.preprocess.media.fetch import FetchedMedia
from encoder_service.types import MODALITIES, EncoderInput, MediaRef, Modality
from mmcore.feature import ItemFacts

# A chat message as the ingress normalised it: ``role`` and ``content``, a string or a list of parts
# ({"type": "text", "text": ...} or {"type": <modality>, "media": MediaRef}); beside them what the
# template reads about tools (router/protocol/messages.py): an assistant message's ``tool_calls``, a
# tool message's ``tool_call_id``, the request's ``tools`` and ``chat_template_kwargs`` on the first message.
Message = Mapping[str, object]
TOOL_KEYS = ("tool_calls", "tool_call_id", "tools", "chat_template_kwargs")


@dataclass
class MediaItem:
    index: int
    ref: MediaRef
    fetched: FetchedMedia | None = None
    mm_hash: str = ""
    facts: ItemFacts | None = None  # from processing it, or from the cache entry
    encoder_input: EncoderInput | None = None
    metadata: dict[str, object] | None = None
    header: Image.Image | None = None  # an image opened (header only) and checked when fetched
    part: dict[str, object] | None = None  # the content part it came from (None: read-only messages)

    def keep_bytes(self, data: bytes) -> None:
        """Put the decoded bytes of a data URL in its content part, in place of the URL."""
        if self.part is not None and self.ref.url is not None:
            self.ref = replace(self.ref, url=None, data=data)
            self.part["media"] = self.ref


def collect_media(
    messages: Sequence[Message], limit_mm_per_prompt: Mapping[Modality, int], model_id: str
) -> tuple[list[dict[str, object]], list[MediaItem]]:
    """The messages the template sees (each media part reduced to its type) and the media items."""
    items: list[MediaItem] = []
    counts = dict.fromkeys(MODALITIES, 0)
    out = []
    for msg in messages:
        content = msg.get("content")
        tool_fields = {k: msg[k] for k in TOOL_KEYS if k in msg}
        if not isinstance(content, list):
            out.append({"role": msg["role"], "content": content or "", **tool_fields})
            continue
        parts = []
        for part in content:
            kind = part.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
                continue
            ref = part.get("media")
            if kind not in MODALITIES or not isinstance(ref, MediaRef) or ref.modality != kind:
                raise InvalidMediaInput(f"content part of type {kind!r} is not a media part", item=len(items))
            counts[kind] += 1
            if counts[kind] > limit_mm_per_prompt[kind]:
                raise TooManyItems(
                    f"{kind} {len(items)}: more than {limit_mm_per_prompt[kind]} {kind} item(s) per "
                    f"prompt (limit_mm_per_prompt) for model {model_id!r}",
                    item=len(items),
                )
            items.append(MediaItem(len(items), ref, part=part if isinstance(part, dict) else None))
            parts.append({"type": kind})
        out.append({"role": msg["role"], "content": parts, **tool_fields})
    return out, items
