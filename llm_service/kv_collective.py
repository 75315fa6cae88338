"""E/P/D's KV hand-off over ``torch.distributed``: NCCL between GPU replicas, gloo between CPU ones.

The prefill rank sends a request's blocks straight out of its paged KV cache; the decode rank receives
them straight into the blocks it allocated (``LLMEngine.reserve_import``'s ``ImportSlots``). Each
layer's cache is ``[2, num_blocks, block_size, heads, head_dim]``, so one block's K (or V) is a
contiguous ``[block_size, heads, head_dim]`` slice, and a run of blocks consecutive on both sides one
contiguous slice too: one send/recv per (layer, K|V, run), all posted at once, then waited for, and no contiguous copy of the sequence on either side, no trip through host
memory on GPUs::

    prefill rank  cache[l][k, src_ids[j]] ──send──▶ recv──▶ cache[l][k, dst_ids[j]]  decode rank

A sliding-window layer's cache moves its own block ids (the window group's), a hybrid model's
linear-attention state slots move as one conv and one recurrent tensor per linear layer
(``kv_parts``). Both sides list the same parts in the same order; each part travels under its index
as the tag. The ops go to the group's own ``send``/``recv``, so a group built outside
``init_process_group`` (llm_service/serve/kv_pair.py's pair groups) works as the default one does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from llm_service.kv_io import _windowed_caches


def runs(ids: Sequence[int], peer: Sequence[int]) -> list[tuple[int, int]]:
    """``(first index, length)`` of the runs over which ``ids`` and the other side's ``peer`` both go up
    by one: one op each. The condition is the same read from either side, so both cut alike."""
    out: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        j = i + 1
        while j < len(ids) and ids[j] == ids[j - 1] + 1 and peer[j] == peer[j - 1] + 1:
            j += 1
        out.append((i, j - i))
        i = j
    return out


def kv_parts(
    runner: Any,
    block_ids: Sequence[int],
    window_ids: Sequence[int] = (),
    state_slots: Sequence[int] = (),
    peer_block_ids: Sequence[int] | None = None,
    peer_window_ids: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """The views a hand-off moves, in the order both sides list them: per KV cache, K then V of each
    run of blocks (``window_ids`` for a sliding-window layer's cache, ``block_ids`` for the others;
    a run: consecutive here and at the peer, whose ids are ``peer_*``, one block each without them),
    then per state slot each linear layer's conv and recurrent state. ``runner`` as kv_io's."""
    if len(block_ids) != len(peer_block_ids if peer_block_ids is not None else block_ids) or len(
        window_ids
    ) != len(peer_window_ids if peer_window_ids is not None else window_ids):
        raise ValueError("a hand-off's two sides list different numbers of blocks")
    full = runs(block_ids, peer_block_ids) if peer_block_ids is not None else _singles(block_ids)
    window = runs(window_ids, peer_window_ids) if peer_window_ids is not None else _singles(window_ids)
    parts: list[torch.Tensor] = []
    for cache, w in zip(runner.kv_caches, _windowed_caches(runner), strict=True):
        ids, cuts = (window_ids, window) if w else (block_ids, full)
        parts += [cache[k_or_v, ids[i] : ids[i] + n] for k_or_v in (0, 1) for i, n in cuts]
    for slot in state_slots:
        assert runner.linear_states is not None, "a state slot without a state cache"
        for conv, rec in zip(runner.linear_states.conv, runner.linear_states.recurrent, strict=True):
            parts += [conv[slot], rec[slot]]
    for part in parts:
        assert part.is_contiguous(), "a run of paged KV blocks (or a state slot) must be one contiguous slice"
    return parts


def _singles(ids: Sequence[int]) -> list[tuple[int, int]]:
    return [(i, 1) for i in range(len(ids))]


def nbytes(parts: Sequence[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in parts)


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if group is not None:
        return group
    default = dist.distributed_c10d._get_default_group()
    return default


def _wait(works: list[Any], device: torch.device) -> None:
    for work in works:
        work.wait()
    if device.type == "cuda":  # the ops ran on the group's stream: done when this returns
        torch.cuda.synchronize(device)


def send_tensors(parts: Sequence[torch.Tensor], dst: int, group: dist.ProcessGroup | None = None) -> int:
    """Send ``parts`` to rank ``dst`` (its ``recv_tensors`` lists the same shapes); returns the bytes sent."""
    pg = _group(group)
    return _post(parts, lambda tag, p: pg.send([p], dst, tag))


def recv_tensors(parts: Sequence[torch.Tensor], src: int, group: dist.ProcessGroup | None = None) -> int:
    """Receive what rank ``src`` sends (``send_tensors``) into ``parts``, in place; returns the bytes."""
    pg = _group(group)
    return _post(parts, lambda tag, p: pg.recv([p], src, tag))


def _post(parts: Sequence[torch.Tensor], op: Callable[[int, torch.Tensor], Any]) -> int:
    """``op(tag, part)`` for each part (its index the tag), all posted before any is waited on."""
    if parts:
        if parts[0].device.type == "cuda":
            torch.cuda.set_device(parts[0].device)
        _wait([op(tag, p) for tag, p in enumerate(parts)], parts[0].device)
    return nbytes(parts)


def _block_parts(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> list[torch.Tensor]:
    return [cache[k_or_v, b] for cache in kv_caches for k_or_v in (0, 1) for b in block_ids]


def send_blocks(
    kv_caches: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    dst: int,
    group: dist.ProcessGroup | None = None,
) -> int:
    """Send blocks ``block_ids`` of every layer's cache to rank ``dst``; returns the bytes sent."""
    return send_tensors(_block_parts(kv_caches, block_ids), dst, group)


def recv_blocks(
    kv_caches: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    src: int,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Receive the blocks rank ``src`` sends (``send_blocks``, in the same order) into ``block_ids``."""
    recv_tensors(_block_parts(kv_caches, block_ids), src, group)
