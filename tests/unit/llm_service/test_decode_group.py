"""Decodes attended together (one padded SDPA per layer) equal decodes attended one by one."""

from __future__ import annotations

import pytest
import torch

from llm_service import attention
from llm_service.attention import TorchPagedAttention, build_metadata

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 8


def _batch() -> list[tuple[int, int, list[int]]]:
    # (start, num_tokens, block_table): three decodes of different lengths around one prefill chunk
    return [(9, 1, [0, 1, 2]), (0, 6, [3, 4]), (2, 1, [5]), (14, 1, [6, 7, 8, 9])]


def _run(window: int | None, group: bool, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    monkeypatch.setattr(attention, "MIN_DECODE_GROUP", 2 if group else 1 << 30)
    chunks = _batch()
    meta = build_metadata(chunks, BLOCK, torch.device("cpu"))
    assert (meta.decode is not None) == group
    g = torch.Generator().manual_seed(0)
    tokens = sum(n for _, n, _ in chunks)
    q = torch.randn(tokens, HEADS, DIM, generator=g)
    k = torch.randn(tokens, KV_HEADS, DIM, generator=g)
    v = torch.randn(tokens, KV_HEADS, DIM, generator=g)
    cache = torch.randn(2, 10, BLOCK, KV_HEADS, DIM, generator=g)  # the older context: random
    return TorchPagedAttention().forward(q, k, v, cache, meta, DIM**-0.5, sliding_window=window)


@pytest.mark.parametrize("window", [None, 3, 8])
def test_grouped_decodes_equal_one_by_one(window: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    grouped = _run(window, True, monkeypatch)
    alone = _run(window, False, monkeypatch)
    torch.testing.assert_close(grouped, alone, rtol=1e-5, atol=1e-6)


def test_group_masks_padding_and_windows() -> None:
    meta = build_metadata([(9, 1, [0, 1, 2]), (2, 1, [5])], BLOCK, torch.device("cpu"))
    g = meta.decode
    assert g is not None and meta.seqs == []
    assert g.lengths.tolist() == [10, 3] and g.rows.tolist() == [0, 1]
    assert g.mask_for(None)[:, 0, 0].tolist() == [[True] * 10, [True] * 3 + [False] * 7]
    assert g.mask_for(4)[0, 0, 0].tolist() == [k >= 6 for k in range(10)]  # sees positions 6..9
    assert g.slots[1, :3].tolist() == [20, 21, 22]  # block 5
