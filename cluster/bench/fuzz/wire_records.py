"""Target: a record's msgpack form (``mmcore.wire``), as a replica reads one another process packed:
``unpack(kind, raw)`` for each record kind, and a whole ``EmbeddingMeta`` (``from_fields``: the
record a cache hit carries). The first byte picks the kind. Expected: the record, or a
``WireVersionError`` (not msgpack, another kind or version, a field missing).
"""

from __future__ import annotations

from encoder_service.types import EmbeddingMeta
from mmcore.wire import WireVersionError, unpack

KINDS = (
    "EmbeddingMeta",
    "EncoderInput",
    "PreprocessedRequest",
    "EncodeBatch",
    "PreparedRequest",
    "LLMRequestSpec",
    "RequestOutput",
)


def one_input(data: bytes) -> None:
    kind = KINDS[data[0] % len(KINDS)] if data else KINDS[0]
    raw = data[1:]
    try:
        if kind == "EmbeddingMeta":
            EmbeddingMeta.from_msgpack(raw)
        else:
            unpack(kind, raw)
    except WireVersionError:
        return
