"""Embeddings a request refers to, fetched from the object store before the engine sees it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, cast

from llm_service.multimodal import MultiModalInput
from mmcore.feature import MediaFeature

if TYPE_CHECKING:
    import torch


class EmbeddingsLost(Exception):
    """Embeddings the request refers to are gone from the object store: their owner (the encoder
    replica that computed them) died, or the fetch timed out. Raised before the request reaches the
    engine, so it holds no KV blocks; the router invalidates ``mm_hashes`` and re-encodes them.
    """

    status_code = 503
    code = "embeddings_lost"

    def __init__(self, mm_hashes: Sequence[str], detail: str = "") -> None:
        self.mm_hashes = list(mm_hashes)
        self.detail = detail
        names = ", ".join(h[:16] for h in self.mm_hashes)
        super().__init__(f"embeddings of {len(self.mm_hashes)} item(s) are lost ({names}): {detail}")

    def __reduce__(self):  # type: ignore[no-untyped-def]  # keeps the fields across pickling (Ray)
        return (type(self), (self.mm_hashes, self.detail))


def is_lost_object(exc: BaseException) -> bool:
    """Ray's ways of saying an object cannot be fetched any more (OwnerDiedError, ObjectFreedError,
    ObjectFetchTimedOutError, ObjectReconstructionFailedError all subclass ObjectLostError)."""
    from ray.exceptions import ObjectLostError

    return isinstance(exc, ObjectLostError | TimeoutError)


async def resolve_embeddings(
    items: Sequence[MediaFeature], fetch: Callable[[object], Awaitable[object]]
) -> list[MultiModalInput]:
    """Fetch each item's embeddings (from the object store) into MultiModalInputs; an item sent with
    its value (``MediaFeature.value``) is not fetched.

    Raises ``EmbeddingsLost`` naming every item whose object is lost (not just the first one).
    """
    if all(it.value is not None for it in items):
        return [MultiModalInput(it, _take_rows(from_stored(it.value), it.rows)) for it in items]
    if len(items) == 1:  # awaited in the caller's task: a gather's task costs two turns of the loop
        tensors: list[object] = [await _settled(fetch(items[0].ref[0]))]
    else:
        tensors = await asyncio.gather(
            *(fetch(it.ref[0]) if it.value is None else _given(it.value) for it in items),
            return_exceptions=True,
        )
    errors = [t for t in tensors if isinstance(t, BaseException)]
    if other := [e for e in errors if not is_lost_object(e)]:
        raise other[0]
    if errors:
        lost = [it.mm_hash for it, t in zip(items, tensors, strict=True) if isinstance(t, BaseException)]
        raise EmbeddingsLost(list(dict.fromkeys(lost)), type(errors[0]).__name__) from errors[0]
    return [
        MultiModalInput(
            it, _take_rows(from_stored(t if it.value is not None else _part(t, it.part)), it.rows)
        )
        for it, t in zip(items, tensors, strict=True)
    ]


def _part(obj: object, part: int | None) -> object:
    """The item's stored form in a fetched object: a step's object holds its items' in a list."""
    if part is None:
        if isinstance(obj, list):  # a record that lost its part on the way: a bug, said plainly
            raise ValueError(f"embeddings object holds {len(obj)} items' parts but the item names none")
        return obj
    if not isinstance(obj, list) or not 0 <= part < len(obj):
        raise ValueError(f"embeddings object holds no part {part} ({type(obj).__name__})")
    return obj[part]


async def _given(value: object) -> object:
    return value


async def _settled(aw: Awaitable[object]) -> object:
    """``await aw``, an exception it raises returned instead (``gather(return_exceptions=True)``)."""
    try:
        return await aw
    except Exception as e:
        return e


def unfetched(items: Sequence[MediaFeature]) -> list[MultiModalInput]:
    """The items as the engine takes them without their embeddings (their spans are in its prefix
    cache): everything but the rows."""
    return [MultiModalInput(it, None) for it in items]


def from_stored(obj: object) -> torch.Tensor:
    """A torch tensor of what an encoder replica put (``encoder_service.serve.deployment.stored_form``): a
    numpy array, or ``(dtype name, integer bits)`` for a dtype numpy lacks; anything else (a tensor)
    passes as is. Copied out of the object store's read-only buffer, so the tensor is writable and
    holds no store memory."""
    import numpy as np
    import torch

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.array(obj))
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[1], np.ndarray):
        name, bits = obj
        return torch.from_numpy(np.array(bits)).view(getattr(torch, name))
    return cast("torch.Tensor", obj)  # put as a tensor already: passed as is


def _take_rows(tensor: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    """The rows of a fetched tensor one placeholder run takes (a Qwen3-VL video frame); None: all."""
    return tensor[rows[0] : rows[1]] if rows else tensor
