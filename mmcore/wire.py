"""The one versioned msgpack wire form of every record that crosses a process boundary, tensors as raw
buffers.

Records (preprocessor → router → encoder pool → router → LLM replica → router) pickle as
``(Class.from_wire, (msgpack bytes, refs))`` through ``__reduce__``: Ray still carries the envelope
and sees any ObjectRefs (so its reference counting holds), but the record's contents are an explicit
schema with a version, not Python object state, so a replica on a newer build reads an older one's
records or refuses them by name. A tensor is ``{"dtype", "shape", "buf"}``: ``buf`` indexes the list of
raw buffers that travels beside the record (C order), so tensor bytes are never copied into msgpack.

    wire record = {"v": WIRE_VERSION, "kind": "<record>", ...fields}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

import msgpack

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

R = TypeVar("R")
Buffers = list["npt.NDArray[np.uint8]"]  # the raw tensor bytes that travel beside a record
Reduced = tuple[Callable[..., object], tuple[object, ...]]  # what ``__reduce__`` gives pickle


class WireTensor(TypedDict):
    dtype: str  # torch's name for it: "float32", "bfloat16", ...
    shape: list[int]
    buf: int  # its index in the buffers beside the record


WIRE_VERSION = 3  # 2: tensor bytes out of band, beside the record; 3: one codec for both services


class WireVersionError(ValueError):
    pass


def pack(kind: str, fields: Mapping[str, object]) -> bytes:
    """msgpack packs its own types in C; ``plain`` is asked only for what it cannot (a numpy scalar in
    metadata, a path in processor kwargs), so a prompt's token ids are never walked in Python."""
    return bytes(msgpack.packb({"v": WIRE_VERSION, "kind": kind, **fields}, use_bin_type=True, default=plain))


def unpack(kind: str, raw: bytes) -> dict[str, Any]:  # Any: msgpack's map; each reader checks its fields
    try:
        d = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (ValueError, TypeError) as e:  # not msgpack; or a map key msgpack cannot hash (a list)
        raise WireVersionError(f"a {kind} record that is not msgpack: {e}") from e
    if not isinstance(d, dict) or d.get("kind") != kind:
        got = d.get("kind") if isinstance(d, dict) else type(d).__name__
        raise WireVersionError(f"expected a record of kind {kind!r}, got {got!r}")
    if d.get("v") != WIRE_VERSION:
        raise WireVersionError(
            f"{kind} wire version {d.get('v')!r} is not supported (this build reads {WIRE_VERSION})"
        )
    return dict(d)


def plain(value: object) -> object:
    """``value`` as msgpack's own types: numpy scalars unwrapped, tuples as lists, keys as strings,
    anything else unknown as its ``str`` (metadata and processor kwargs are for logs and replay)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if getattr(value, "ndim", None) == 0 and (item := getattr(value, "item", None)) is not None:
        return plain(item())  # a numpy / torch scalar
    if (tolist := getattr(value, "tolist", None)) is not None:  # a small array in metadata
        return plain(tolist())
    return str(value)


def pack_tensor(t: torch.Tensor | npt.NDArray[np.generic], buffers: Buffers) -> WireTensor:
    """A tensor (torch, or a numpy array: it comes back as torch) as dtype name and shape; its bytes
    go to ``buffers`` as a flat uint8 numpy array (any dtype, bfloat16 included), which pickle
    protocol 5 (Ray's) carries out of band: no copy into the record, zero-copy reads on a node."""
    import torch

    if not isinstance(t, torch.Tensor):
        import numpy as np

        t = torch.from_numpy(np.ascontiguousarray(t))
    t = t.detach().contiguous().cpu()
    buffers.append(t.reshape(-1).view(torch.uint8).numpy())
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "buf": len(buffers) - 1}


def unpack_tensor(d: WireTensor, buffers: Buffers) -> torch.Tensor:
    import warnings

    import torch

    dtype = getattr(torch, d["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise WireVersionError(f"unknown tensor dtype {d['dtype']!r}")
    raw = buffers[int(d["buf"])]
    with warnings.catch_warnings():  # read-only when zero-copy from the object store; never written
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(raw)
    return flat.view(dtype).reshape([int(n) for n in d["shape"]])


def to_fields(record: object, beside: Collection[str] = (), omit_defaults: bool = False) -> dict[str, object]:
    """A dataclass record's fields for ``pack``, those named in ``beside`` left out (they travel next
    to the bytes: ObjectRefs, arrays, records of their own). Derived from the fields, so none can be
    dropped. ``omit_defaults``: a field at its default is left out too (``from_fields`` gives it
    back), for records stored many times over."""
    assert dataclasses.is_dataclass(record) and not isinstance(record, type)
    out = {}
    for f in dataclasses.fields(record):
        if f.name in beside:
            continue
        value = getattr(record, f.name)
        if omit_defaults and f.default is not dataclasses.MISSING and value == f.default:
            continue
        out[f.name] = value
    return out


def from_fields(cls: type[R], d: Mapping[str, object], **beside: object) -> R:
    """``cls`` from ``to_fields``'s form plus the fields that travelled ``beside`` it. A field missing
    from ``d`` takes its default (a record from a build before the field was added); a tuple field
    (a grid, a row range) comes back as a tuple. A field without a default missing from both:
    ``WireVersionError`` naming it (a record from another build, or not one at all)."""
    tuples, names, required = _field_names(cls)
    values = {name: d[name] for name in names if name in d and name not in beside}
    if missing := [name for name in required if name not in values and name not in beside]:
        raise WireVersionError(f"{cls.__name__} wire record lacks {', '.join(missing)}")
    for name in tuples:
        if isinstance(value := values.get(name), list):
            values[name] = tuple(value)
    return cls(**values, **beside)


_FIELD_NAMES: dict[type, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {}


def _field_names(cls: type) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(the fields annotated as tuples, every field, the fields without a default) of a dataclass."""
    if (names := _FIELD_NAMES.get(cls)) is None:
        fields = dataclasses.fields(cls)
        tuples = tuple(f.name for f in fields if str(f.type).startswith("tuple["))
        required = tuple(
            f.name
            for f in fields
            if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        names = _FIELD_NAMES[cls] = (tuples, tuple(f.name for f in fields), required)
    return names
