"""The paged KV cache's size: what one block of tokens costs over the layers that write KV, how many
blocks a memory budget holds (the sliding-window layers' own group first, where a model has one),
and the caches themselves, one tensor per KV-writing layer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llm_service.config import EngineConfig
from llm_service.kv_cache_manager import cdiv
from llm_service.window_kv_cache_manager import window_blocks_needed

if TYPE_CHECKING:
    from llm_service.models.qwen2 import TextConfig

logger = logging.getLogger(__name__)

CPU_KV_CACHE_CAP_BYTES = 1 << 30


def sliding_window(text_config: TextConfig, config: EngineConfig) -> int | None:
    """The sliding window whose layers get their own block group: models with one window size and
    full layers beside (a model of window layers only, or of several sizes, keeps one group)."""
    windows = text_config.kv_layer_windows()
    sizes = {w for w in windows if w is not None}
    if len(sizes) != 1 or None not in windows or not config.sliding_window_blocks:
        return None
    return sizes.pop()


@dataclass(frozen=True)
class KVCacheSizing:
    """One model's KV block costs under one engine config (``window``: the window group's, or None)."""

    text_config: TextConfig
    config: EngineConfig
    dtype: torch.dtype
    window: int | None

    @property
    def window_cap(self) -> int:
        """What the batch can read of the window layers' own pool at once (0: they have none)."""
        c = self.config
        if self.window is None:
            return 0
        return window_blocks_needed(c.max_num_seqs, c.max_num_batched_tokens, self.window, c.block_size)

    def layer_windows(self) -> list[int | None]:
        """Per KV cache: its layers' window when the window layers keep their own blocks, else None."""
        windows = self.text_config.kv_layer_windows()
        return windows if self.window is not None else [None] * len(windows)

    def bytes_per_block(self, windowed: bool | None) -> int:
        """One block's K and V over the layers that write KV (``windowed``: only the window layers'
        caches, or only the others'; None: all of them: what a block of tokens costs unwindowed)."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per_token = sum(
            h * d
            for (h, d), w in zip(
                self.text_config.kv_layer_specs(), self.text_config.kv_layer_windows(), strict=True
            )
            if windowed is None or (w is not None) == windowed
        )
        return 2 * self.config.block_size * per_token * elem

    @property
    def block_bytes(self) -> int:
        """One block's K and V over every layer that writes KV (what a block of tokens costs)."""
        return self.bytes_per_block(None)

    def blocks_for(self, budget: int, want: int | None) -> int:
        """Full-group blocks that ``budget`` bytes hold (at most ``want``), after the window group's
        blocks (as many as the batch can hold at once, ``window_blocks_needed``) where there is one."""
        if self.window is None:
            n = budget // self.block_bytes
            return n if want is None else min(want, n)
        both = budget // self.block_bytes  # every layer's block: no fewer full blocks than this
        n_window = min(self.window_cap, both if want is None else min(want, both))
        n = (budget - (n_window + 1) * self.bytes_per_block(True)) // self.bytes_per_block(False)
        return max(0, n if want is None else min(want, n))

    def derive_num_blocks(self, device: torch.device) -> int:
        c = self.config
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = int(total * c.kv_cache_memory_fraction) - (total - free)
            n = self.blocks_for(budget, None)
            if n <= 0:
                raise RuntimeError(f"no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free)")
        else:
            want = c.max_num_seqs * cdiv(min(c.max_model_len, 2048), c.block_size)
            n = max(1, self.blocks_for(CPU_KV_CACHE_CAP_BYTES, want))
        if self.window is None:
            mib = n * self.block_bytes / 2**20
        else:
            n_window = min(n, self.window_cap) + 1
            mib = (n * self.bytes_per_block(False) + n_window * self.bytes_per_block(True)) / 2**20
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", n, c.block_size, mib)
        return int(n)

    def allocate(self, num_blocks: int, num_window_blocks: int, device: torch.device) -> list[torch.Tensor]:
        """One cache per KV-writing layer (Gemma 4: shared layers own none, full layers are wider);
        a sliding-window layer's holds the window group's blocks only (and a null block besides)."""
        bs = self.config.block_size
        return [
            torch.zeros(
                (2, num_blocks if w is None else num_window_blocks + 1, bs, h, d),
                dtype=self.dtype,
                device=device,
            )
            for (h, d), w in zip(self.text_config.kv_layer_specs(), self.layer_windows(), strict=True)
        ]
