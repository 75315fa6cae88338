"""NearCache: bounded by entries (least recently used out first) and by time; drop forgets at once."""

from __future__ import annotations

import pytest

from encoder_service.cache.near_cache import NearCache
from encoder_service.types import EmbeddingMeta
from tests.fakes import Clock


def _meta(h: str) -> EmbeddingMeta:
    return EmbeddingMeta(h, "image", 4, 8, "float32", (1, 4, 4))


def test_an_entry_is_served_until_its_ttl_then_forgotten() -> None:
    clock = Clock()
    near = NearCache(4, ttl_s=10.0, clock=clock)
    near.put(_meta("a"), "ref-a")
    clock.now = 9.9
    assert near.get("a") == (_meta("a"), "ref-a")
    clock.now = 10.0
    assert near.get("a") is None and len(near) == 0
    assert near.stats() == {"entries": 0, "hits": 1, "misses": 1}


def test_putting_again_renews_the_ttl() -> None:
    clock = Clock()
    near = NearCache(4, ttl_s=10.0, clock=clock)
    near.put(_meta("a"), "ref-a")
    clock.now = 8.0
    near.put(_meta("a"), "ref-a2")  # the index answered again: a fresh entry
    clock.now = 15.0
    assert near.get("a") == (_meta("a"), "ref-a2")


def test_the_least_recently_used_goes_first_past_max_entries() -> None:
    near = NearCache(2, ttl_s=10.0)
    near.put(_meta("a"), 1)
    near.put(_meta("b"), 2)
    assert near.get("a") is not None  # a is now the most recent
    near.put(_meta("c"), 3)
    assert near.get("b") is None and near.get("a") is not None and near.get("c") is not None


def test_drop_and_a_zero_bound_keep_nothing() -> None:
    near = NearCache(2, ttl_s=10.0)
    near.put(_meta("a"), 1)
    near.drop(["a", "never-put"])
    assert near.get("a") is None
    for off in (NearCache(0, 10.0), NearCache(4, 0.0)):
        off.put(_meta("a"), 1)
        assert len(off) == 0


def test_negative_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        NearCache(-1, 1.0)


def test_a_prepare_reply_carries_its_metas_across_pickling() -> None:
    """What the ingress's near cache learns from a ``prepare`` reply survives Ray's pickling."""
    import pickle

    from encoder_service.preprocess.prepared import PreparedRequest
    from mmcore.feature import MediaFeature

    meta = EmbeddingMeta("h", "video", 12, 8, "float32", (2, 4, 6), 0.5, [0.0, 1.0], units=2)
    prepared = PreparedRequest(
        [1] * 20, [MediaFeature(0, "video", "h", 3, 12, grid_thw=(2, 4, 6), ref=["r"])], 1, {}, [meta]
    )
    back = pickle.loads(pickle.dumps(prepared))
    assert back.metas == [meta] and back.items[0].ref == ["r"]


def test_purge_releases_every_expired_entry_at_once() -> None:
    clock = Clock()
    near = NearCache(4, ttl_s=10.0, clock=clock)
    near.put(_meta("a"), 1)
    clock.now = 5.0
    near.put(_meta("b"), 2)
    clock.now = 12.0
    assert near.purge() == 1 and len(near) == 1 and near.get("b") is not None
