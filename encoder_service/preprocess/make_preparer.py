"""``make_preparer``: a ``RequestPreparer`` over a model's processor and the shared cache, as the
encoder replicas that prepare and the ingress's hit path each build one (the ingress's over its
tokenizer and the model's ``HitPathFacts`` instead of the processor: it processes nothing)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypedDict

from encoder_service.cache.uuid_aliases import AliasStore
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.prepare import CacheIndex, Encode, EncodeEach, RequestPreparer
from encoder_service.preprocess.stage_timing import MediaStages

if TYPE_CHECKING:
    from encoder_service.preprocess.hit_path_family import Tokenizer
    from encoder_service.preprocess.processing import Preprocessor


class PreprocessArgs(TypedDict):
    """What preparing a model's requests takes from its config (``make_preparer``'s keywords)."""

    limits: MediaLimits
    limit_mm_per_prompt: dict[str, int]
    processor_cache_bytes: int
    chat_template: str | None  # the model's override of its checkpoint's template (text); None: its own


class SharedCache(CacheIndex, AliasStore, Protocol):
    """The shared cache as a preparer uses it: its index, and the uuid names kept in its shards
    (``encoder_service.cache.cache_client.EncoderCacheClient``)."""


def make_preparer(
    model_dir: str,
    *,
    limits: MediaLimits,
    limit_mm_per_prompt: dict[str, int],
    processor_cache_bytes: int,
    cache: SharedCache,
    chat_template: str | None = None,
    encode: Encode,
    model_name: str = "",
    stages: MediaStages | None = None,
    encode_each: EncodeEach | None = None,
    tokenizer: Tokenizer | None = None,
) -> RequestPreparer:
    """A ``RequestPreparer`` over this model's processor, the shared cache client and ``encode`` (the
    encoder pool's handle, or an encoder replica's own FIFO when it prepares itself).
    ``tokenizer``: the ingress's hit path, which processes nothing: the model's ``HitPathFacts``
    and this tokenizer (with ``chat_template`` set already) stand in for the processor."""
    from encoder_service.preprocess.processing import Preprocessor

    family = None
    if tokenizer is not None:
        from encoder_service.preprocess.hit_path_facts import read_hit_path_facts
        from encoder_service.preprocess.hit_path_family import HitPathFamily

        family = HitPathFamily(read_hit_path_facts(model_dir), tokenizer, limits)
    preprocessor = Preprocessor(
        model_dir,
        limits,
        limit_mm_per_prompt,
        processor_cache_bytes,
        model_id=model_name or None,
        stages=stages,
        chat_template=chat_template,
        family=family,
    )
    preprocessor.aliases = cache  # uuid names live in the cache shards (uuid_aliases.py)
    return RequestPreparer(preprocessor, cache, encode, stages=stages, encode_each=encode_each)


def preparer_stats(preparer: RequestPreparer) -> dict[str, object]:
    pre = preparer.preprocessor
    if TYPE_CHECKING:
        assert isinstance(pre, Preprocessor)
    return {"processor_calls": pre.num_processor_calls, "processor_cache": pre.processor_cache.stats()}
