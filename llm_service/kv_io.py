"""A request's KV blocks out of one replica's paged caches and into another's (E/P/D's hand-off, the
decode side's swap): the full-attention layers' blocks, a sliding-window layer's still-read blocks, a
hybrid model's linear-attention states, as host bytes (``KVBlocks``, llm_service/kv_handoff.py).

``runner`` is a ``ModelRunner`` or anything with what these read of it: ``kv_caches``, ``config.dtype``,
``device``, ``window`` (and ``text_config`` where it is set), ``linear_states`` for states
(cluster/bench/kv_transfer.py passes a stand-in)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from llm_service.kv_handoff import KVBlocks
from llm_service.kv_swap import SwapSizes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_kv_blocks(
    runner: Any,
    request_id: str,
    block_ids: list[int],
    from_block: int,
    window_ids: Sequence[int] = (),
    window_from: int = 0,
    state_slot: int | None = None,
    snapshot_slot: int | None = None,
) -> KVBlocks:
    """Copy blocks ``block_ids`` of every full-attention layer, ``window_ids`` of every sliding-window
    layer, and a hybrid model's states in ``state_slot`` (and ``snapshot_slot``) to host memory:
    what crosses the wire."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=runner.device)
    widx = torch.tensor(list(window_ids), dtype=torch.long, device=runner.device)
    windowed = _windowed_caches(runner)
    layers = [
        cache.index_select(1, widx if w else idx).cpu()
        for cache, w in zip(runner.kv_caches, windowed, strict=True)
    ]
    states: list[torch.Tensor] = []
    for slot in (state_slot, snapshot_slot if state_slot is not None else None):
        if slot is not None:
            assert runner.linear_states is not None, "a state slot without a state cache"
            for conv, rec in zip(runner.linear_states.conv, runner.linear_states.recurrent, strict=True):
                states += [conv[slot].cpu(), rec[slot].cpu()]
    return KVBlocks(
        request_id,
        from_block,
        len(block_ids),
        runner.config.dtype,
        [tuple(t.shape) for t in layers],
        [_raw(t) for t in layers],
        window_from=window_from,
        snapshot=state_slot is not None and snapshot_slot is not None,
        state_shapes=[tuple(t.shape) for t in states],
        state_dtypes=[_DTYPE_NAMES[t.dtype] for t in states],
        states=[_raw(t) for t in states],
    )


def write_kv_blocks(
    runner: Any,
    block_ids: list[int],
    blocks: KVBlocks,
    window_ids: Sequence[int] = (),
    state_slot: int | None = None,
    snapshot_slot: int | None = None,
) -> None:
    """Write pulled blocks into this replica's blocks ``block_ids`` (a window layer's into
    ``window_ids``), block by block (no contiguous copy of the sequence), and pulled states into
    ``state_slot``; checked against this model's layout first."""
    windowed = _windowed_caches(runner)
    want = [
        (2, len(window_ids) if w else len(block_ids), *c.shape[2:])
        for c, w in zip(runner.kv_caches, windowed, strict=True)
    ]
    if blocks.dtype != runner.config.dtype or [tuple(s) for s in blocks.shapes] != want:
        raise ValueError(
            f"pulled KV of {blocks.dtype} {blocks.shapes} does not fit {runner.config.dtype} {want}"
        )
    _check_states(runner, blocks, state_slot)
    dtype = DTYPES[blocks.dtype]
    for cache, shape, raw, w in zip(runner.kv_caches, blocks.shapes, blocks.data, windowed, strict=True):
        if shape[1] == 0:  # a window layer's part of a chunk's pull (its blocks come last)
            continue
        layer = _tensor(raw, dtype, shape)
        for j, block_id in enumerate(window_ids if w else block_ids):
            cache[:, block_id].copy_(layer[:, j], non_blocking=True)
    if state_slot is not None:
        assert runner.linear_states is not None
        tensors = [
            _tensor(raw, DTYPES[name], shape)
            for raw, name, shape in zip(blocks.states, blocks.state_dtypes, blocks.state_shapes, strict=True)
        ]
        pairs = list(zip(runner.linear_states.conv, runner.linear_states.recurrent, strict=True))
        # a snapshot this side reserved no slot for (its cache held the block): not written
        slots = [state_slot, snapshot_slot] if blocks.snapshot else [state_slot]
        for k, slot in enumerate(s for s in slots if s is not None):
            for j, (conv, rec) in enumerate(pairs):
                conv[slot].copy_(tensors[2 * (k * len(pairs) + j)])
                rec[slot].copy_(tensors[2 * (k * len(pairs) + j) + 1])
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def swap_sizes(runner: Any) -> SwapSizes:
    """Host bytes of what ``read_kv_blocks`` copies per full-attention block (every full layer's K
    and V), per sliding-window block, and per state slot: a swap's size before it is read."""
    windowed = _windowed_caches(runner)
    per = [c[:, 0].numel() * c.element_size() for c in runner.kv_caches]
    state = 0
    if (states := getattr(runner, "linear_states", None)) is not None:
        state = sum(t[0].numel() * t.element_size() for t in (*states.conv, *states.recurrent))
    return SwapSizes(
        sum(n for n, w in zip(per, windowed, strict=True) if not w),
        sum(n for n, w in zip(per, windowed, strict=True) if w),
        state,
    )


_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _tensor(raw: bytes, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(tuple(shape))


def _windowed_caches(runner: Any) -> list[bool]:
    """Per KV cache: whether it is a sliding-window layer's (the window group's blocks). A function of
    what it reads (``window``, ``kv_caches``), so a stand-in runner (cluster/bench/kv_transfer.py)
    needs no more."""
    if runner.window is None:
        return [False] * len(runner.kv_caches)
    return [w is not None for w in runner.text_config.kv_layer_windows()]


def _check_states(runner: Any, blocks: KVBlocks, state_slot: int | None) -> None:
    """The pulled states fit this model's state cache (none when the import takes none)."""
    want: list[tuple[tuple[int, ...], str]] = []
    if state_slot is not None and (states := runner.linear_states) is not None:
        for conv, rec in zip(states.conv, states.recurrent, strict=True):
            want += [(tuple(t.shape[1:]), _DTYPE_NAMES[t.dtype]) for t in (conv, rec)]
        want *= 2 if blocks.snapshot else 1
    got = [(tuple(s), d) for s, d in zip(blocks.state_shapes, blocks.state_dtypes, strict=True)]
    if got != want:
        raise ValueError(f"pulled linear-attention states {got} do not fit this model's {want}")
