"""A small item's value sent inline beside its ref by the encoder replica that put it
(``MediaFeature.value``): it crosses the prepared request's and the spec's
wire forms, the LLM side takes it without fetching, and items sent without one are fetched (and
reported lost) as before."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import numpy as np
import pytest
import torch

from encoder_service.preprocess.prepared import PreparedRequest, with_values
from encoder_service.serve.deployment import stored_form
from llm_service.embeddings import EmbeddingsLost, resolve_embeddings
from llm_service.request_spec import LLMRequestSpec
from llm_service.sampling_params import SamplingParams
from mmcore.feature import MediaFeature


def _items() -> list[MediaFeature]:
    pre = PreparedRequest(
        [1] * 20,
        [
            MediaFeature(0, "image", "h1", 2, 4, grid_thw=(1, 4, 4), ref=["ref1"]),
            MediaFeature(1, "image", "h2", 8, 4, grid_thw=(1, 4, 4), ref=["ref2"]),
        ],
        1,
        {},
    )
    held = {"ref1": stored_form(torch.full((4, 3), 1.5, dtype=torch.bfloat16))}
    back = pickle.loads(pickle.dumps(with_values(pre, held.get)))  # the answer to the ingress
    assert back == pre and back.items[1].value is None
    return back.items


def test_values_cross_the_spec_wire_form_beside_their_refs() -> None:
    spec = LLMRequestSpec("r", [1] * 20, SamplingParams(max_tokens=1), _items())
    back = pickle.loads(pickle.dumps(spec))
    with_value, without = back.mm_items
    assert with_value.ref == ["ref1"] and without.ref == ["ref2"] and without.value is None
    name, bits = with_value.value
    assert name == "bfloat16" and isinstance(bits, np.ndarray)
    plain = LLMRequestSpec(
        "r", [1] * 20, SamplingParams(max_tokens=1), [MediaFeature(0, "image", "h", 0, 4, ref=["r"])]
    )
    assert pickle.loads(pickle.dumps(plain)).mm_items[0].value is None


def test_an_item_with_its_value_is_not_fetched_and_the_others_are() -> None:
    fetched: list[Any] = []

    async def fetch(ref: Any) -> Any:
        fetched.append(ref)
        return stored_form(torch.full((4, 3), 2.0))

    first, second = asyncio.run(resolve_embeddings(_items(), fetch))
    assert fetched == ["ref2"]
    assert first.embeddings.dtype == torch.bfloat16 and first.embeddings.float().eq(1.5).all()
    assert second.embeddings.eq(2.0).all()
    (only,) = asyncio.run(resolve_embeddings(_items()[:1], fetch))
    assert fetched == ["ref2"] and only.embeddings.float().eq(1.5).all()


def test_a_lost_object_beside_an_inline_value_is_still_reported() -> None:
    from ray.exceptions import ObjectLostError

    async def fetch(ref: Any) -> Any:
        raise ObjectLostError("0" * 56, "", "")

    with pytest.raises(EmbeddingsLost) as e:
        asyncio.run(resolve_embeddings(_items(), fetch))
    assert e.value.mm_hashes == ["h2"]


def test_items_of_one_encoder_step_share_its_object_and_take_their_own_part() -> None:
    """An encoder step puts one object (a list of its items' stored forms): each item's record names
    its part; the LLM side takes that part, and the replica's recent values are kept per part."""
    from encoder_service.encode.recent_values import RecentValues, value_key

    forms = [stored_form(torch.full((4, 3), float(i))) for i in range(3)]
    recent = RecentValues()
    for i, form in enumerate(forms):
        recent.put(value_key("step", i), form, 48)
    items = [MediaFeature(i, "image", f"h{i}", 2 + 4 * i, 4, ref=["step"], part=i) for i in range(3)]
    pre = PreparedRequest([1] * 20, items, 3, {})
    inline = pickle.loads(
        pickle.dumps(with_values(pre, lambda ref, part: recent.get(value_key(str(ref), part))))
    )
    assert [it.part for it in inline.items] == [0, 1, 2]
    assert [float(np.asarray(it.value)[0, 0]) for it in inline.items] == [0.0, 1.0, 2.0]

    fetched: list[Any] = []

    async def fetch(ref: Any) -> Any:
        fetched.append(ref)
        return forms

    got = asyncio.run(resolve_embeddings([items[2], items[0]], fetch))
    assert fetched == ["step", "step"]
    assert [float(g.embeddings[0, 0]) for g in got] == [2.0, 0.0]
    with pytest.raises(ValueError, match="names none"):
        asyncio.run(resolve_embeddings([MediaFeature(0, "image", "h", 2, 4, ref=["step"])], fetch))
    with pytest.raises(ValueError, match="no part 5"):
        asyncio.run(resolve_embeddings([MediaFeature(0, "image", "h", 2, 4, ref=["step"], part=5)], fetch))
