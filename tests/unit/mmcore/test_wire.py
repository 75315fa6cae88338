"""Records between pools pickle as versioned msgpack: round trips, the wire bytes, version checks."""

from __future__ import annotations

import pickle

import msgpack
import pytest
import torch

from encoder_service.types import (
    EmbeddingMeta,
    EncodeBatch,
    EncodedItem,
    EncoderInput,
    PreprocessedRequest,
)
from llm_service.outputs import RequestOutput, TokenLogprob
from llm_service.request_spec import LLMRequestSpec
from llm_service.sampling_params import SamplingParams
from mmcore.feature import MediaFeature
from mmcore.wire import WireVersionError


def roundtrip(obj: object) -> object:
    return pickle.loads(pickle.dumps(obj))


def encoder_input(seed: int = 0) -> EncoderInput:
    g = torch.Generator().manual_seed(seed)
    return EncoderInput(
        mm_hash=f"{seed:064x}",
        modality="image",
        num_embeds=4,
        grid_thw=(1, 4, 4),
        tensors={
            "pixel_values": torch.randn(16, 12, generator=g),
            "half": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "image_grid_thw": torch.tensor([[1, 4, 4]]),
            "empty": torch.zeros(0, 3),
        },
    )


def assert_same_input(a: EncoderInput, b: EncoderInput) -> None:
    assert (a.mm_hash, a.modality, a.num_embeds, a.grid_thw) == (
        b.mm_hash,
        b.modality,
        b.num_embeds,
        b.grid_thw,
    )
    assert a.tensors.keys() == b.tensors.keys()
    for k in a.tensors:
        assert a.tensors[k].dtype == b.tensors[k].dtype and torch.equal(a.tensors[k], b.tensors[k]), k


def test_encoder_input_and_batch_roundtrip_bit_exact() -> None:
    x = encoder_input()
    y = roundtrip(x)
    assert isinstance(y, EncoderInput)
    assert_same_input(x, y)
    batch = roundtrip(EncodeBatch("req-1", [encoder_input(1), encoder_input(2)]))
    assert isinstance(batch, EncodeBatch) and batch.request_id == "req-1" and batch.num_embeds == 8
    for ours, ref in zip(batch.inputs, [encoder_input(1), encoder_input(2)], strict=True):
        assert_same_input(ours, ref)


def test_preprocessed_request_roundtrip() -> None:
    items = [
        MediaFeature(0, "image", "a" * 64, 3, 4, (1, 4, 4), metadata={"width": 56}, data=encoder_input()),
        MediaFeature(1, "video", "b" * 64, 9, 2, (2, 2, 2), 0.5, rows=(2, 4), metadata={"seconds": 1.5}),
    ]
    pre = PreprocessedRequest([1, 2, 3] + [7] * 4 + [5, 6] + [8] * 2, items, {"fps": 2.0})
    back = roundtrip(pre)
    assert isinstance(back, PreprocessedRequest)
    assert back.prompt_token_ids == pre.prompt_token_ids and back.processor_kwargs == {"fps": 2.0}
    assert back.items == items and back.items[1].rows == (2, 4) and back.items[1].grid_thw == (2, 2, 2)
    assert [it.metadata for it in back.items] == [{"width": 56}, {"seconds": 1.5}]
    assert back.items[1].data is None and isinstance(back.items[0].data, EncoderInput)
    assert_same_input(back.items[0].data, encoder_input())


def test_embedding_meta_wire_bytes_are_the_documented_msgpack() -> None:
    meta = EmbeddingMeta("c" * 64, "video", 12, 64, "bfloat16", (2, 4, 6))
    expected = msgpack.packb(
        {
            "v": 3,
            "kind": "EmbeddingMeta",
            "mm_hash": "c" * 64,
            "modality": "video",
            "num_embeds": 12,
            "hidden_size": 64,
            "dtype": "bfloat16",
            "grid_thw": [2, 4, 6],
        },
        use_bin_type=True,
    )
    assert meta.to_msgpack() == expected
    assert roundtrip(meta) == meta
    item = roundtrip(EncodedItem(meta, ["stand-in for an ObjectRef"]))
    assert isinstance(item, EncodedItem) and item.meta == meta and item.ref == ["stand-in for an ObjectRef"]


def test_llm_request_spec_and_outputs_roundtrip() -> None:
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, seed=3, stop_token_ids=(4, 9))
    items = [
        MediaFeature(0, "image", "d" * 64, 2, 4, grid_thw=(1, 4, 4), ref=["ref-a"]),
        MediaFeature(0, "audio", "e" * 64, 8, 3, ref=["ref-b"]),
    ]
    spec = LLMRequestSpec("r", [1, 2, 3], params, items, [b"\x01" * 16, b"\x02" * 16])
    back = roundtrip(spec)
    assert isinstance(back, LLMRequestSpec)
    assert (back.request_id, back.prompt_token_ids, back.sampling_params) == ("r", [1, 2, 3], params)
    assert list(back.mm_items) == items and list(back.block_hashes) == [b"\x01" * 16, b"\x02" * 16]
    # The pickle carries the msgpack bytes and the refs, not the dataclasses' Python state.
    assert b"SamplingParams" not in pickle.dumps(spec) and b"MediaFeature" not in pickle.dumps(spec)

    out = RequestOutput(
        "r",
        [5, 6],
        [TokenLogprob(5, -0.25, [(5, -0.25), (6, -1.5)]), TokenLogprob(6, -2.0, [])],
        True,
        "length",
        3,
        0,
    )
    assert roundtrip(out) == out
    plain = RequestOutput("r", [5], None, False, None, 3, 2)
    assert roundtrip(plain) == plain


def test_a_records_wire_form_is_derived_from_its_fields() -> None:
    """A field added to the item record crosses every hop with no codec edit: the wire form is its
    fields (those beside it excepted), so no side can drop it."""
    import dataclasses

    from mmcore.wire import from_fields, to_fields

    Grown = dataclasses.make_dataclass(
        "Grown",
        [("new_fact", "tuple[int, int] | None", dataclasses.field(default=None))],
        bases=(MediaFeature,),
        frozen=True,
    )
    grown = Grown(2, "video", "g" * 64, 5, 6, (2, 2, 6), new_fact=(7, 8), ref=["r"], data="tensors")
    d = msgpack.unpackb(msgpack.packb(to_fields(grown, MediaFeature.BESIDE)), raw=False)
    assert d["new_fact"] == [7, 8] and "ref" not in d and "data" not in d
    back = from_fields(Grown, d, ref=["r"])
    assert back == grown and back.new_fact == (7, 8) and back.data is None


def test_item_facts_are_declared_by_the_records_and_handed_whole() -> None:
    """The encoder's input and the cache entry declare ``ItemFacts``' fields (same names, same types)
    and give and take them whole: a video's facts survive input -> cache entry -> wire, no field
    spelled out on the way."""
    import dataclasses

    from mmcore.feature import ItemFacts

    facts = {f.name: f.type for f in dataclasses.fields(ItemFacts)}
    for record in (EncoderInput, EmbeddingMeta):
        declared = {f.name: f.type for f in dataclasses.fields(record)}
        assert {k: declared.get(k) for k in facts} == facts, record.__name__
    video = ItemFacts(12, (2, 4, 6), 0.5, [0.25, 0.75])
    inp = roundtrip(EncoderInput.of("v" * 64, "video", video, {"pixel_values_videos": torch.zeros(48, 12)}))
    assert isinstance(inp, EncoderInput) and inp.facts == video
    meta = roundtrip(EmbeddingMeta.of(inp.mm_hash, "video", inp.facts, 64, "bfloat16", units=3))
    assert isinstance(meta, EmbeddingMeta) and meta.facts == video and meta.cache_charge == 36


def test_other_wire_versions_and_kinds_are_refused_by_name() -> None:
    from encoder_service.types import _encoder_input_from_bytes
    from llm_service.outputs import _request_output_from_bytes

    newer = msgpack.packb({"v": 4, "kind": "RequestOutput"}, use_bin_type=True)
    with pytest.raises(WireVersionError, match="RequestOutput wire version 4"):
        _request_output_from_bytes(newer)
    with pytest.raises(WireVersionError, match="expected a record of kind 'EncoderInput', got 'EncodeBatch'"):
        _encoder_input_from_bytes(msgpack.packb({"v": 3, "kind": "EncodeBatch"}, use_bin_type=True), [])
    with pytest.raises(WireVersionError, match="EmbeddingMeta wire version 0"):
        EmbeddingMeta.from_msgpack(msgpack.packb({"v": 0, "kind": "EmbeddingMeta"}, use_bin_type=True))


def test_a_record_missing_a_required_field_is_refused_by_name() -> None:
    # found by the wire_records fuzz target (cluster/bench/fuzz): a TypeError from the dataclass before
    raw = msgpack.packb({"v": 3, "kind": "EmbeddingMeta", "mm_hash": "a", "modality": "image"})
    with pytest.raises(
        WireVersionError, match="EmbeddingMeta wire record lacks num_embeds, hidden_size, dtype"
    ):
        EmbeddingMeta.from_msgpack(raw)
    full = EmbeddingMeta("a", "image", 4, 8, "float32")  # the optional fields take their defaults
    raw = msgpack.packb(
        {
            "v": 3,
            "kind": "EmbeddingMeta",
            "mm_hash": "a",
            "modality": "image",
            "num_embeds": 4,
            "hidden_size": 8,
            "dtype": "float32",
        }
    )
    assert EmbeddingMeta.from_msgpack(raw) == full


def test_bytes_that_are_not_a_msgpack_record_are_refused_by_name() -> None:
    # found by the wire_records fuzz target: a map keyed by a list was msgpack's TypeError
    list_key = b"\x81\x91\x01\x01"  # {[1]: 1}
    with pytest.raises(WireVersionError, match="a EmbeddingMeta record that is not msgpack"):
        EmbeddingMeta.from_msgpack(list_key)
    with pytest.raises(WireVersionError, match="not msgpack"):
        EmbeddingMeta.from_msgpack(b"\x92\x01")  # a truncated array


def test_numpy_tensors_and_non_msgpack_metadata_cross_as_plain_values() -> None:
    from pathlib import Path

    import numpy as np

    x = EncoderInput(
        "f" * 64, "audio", 2, None, {"input_features": np.arange(6, dtype=np.float32).reshape(1, 2, 3)}
    )
    back = roundtrip(x)
    assert isinstance(back, EncoderInput)
    assert torch.equal(back.tensors["input_features"], torch.arange(6, dtype=torch.float32).reshape(1, 2, 3))
    item = MediaFeature(0, "audio", "f" * 64, 1, 2, metadata={"seconds": np.float32(1.5), "shape": (2, 3)})
    pre = roundtrip(PreprocessedRequest([1, 2, 3], [item], {"fps": np.int64(2), "root": Path("/m")}))
    assert isinstance(pre, PreprocessedRequest)
    assert pre.items[0].metadata == {"seconds": 1.5, "shape": [2, 3]}
    assert pre.processor_kwargs == {"fps": 2, "root": "/m"}


def test_tensor_bytes_travel_out_of_band_not_inside_the_record() -> None:
    """Pickle protocol 5 (what Ray uses) hands tensor bytes over as separate buffers: zero-copy."""
    x = EncoderInput("e" * 64, "image", 4, (1, 4, 4), {"pixel_values": torch.randn(256, 1176)})
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(x, protocol=5, buffer_callback=buffers.append)
    assert len(payload) < 4096  # the record: names, shapes, dtypes; not the 1.2 MB of pixels
    assert sum(memoryview(b).nbytes for b in buffers) == 256 * 1176 * 4
    back = pickle.loads(payload, buffers=buffers)
    assert torch.equal(back.tensors["pixel_values"], x.tensors["pixel_values"])
