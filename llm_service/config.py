"""Engine configuration (frozen; built by cluster/ from the pool's config section)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """What one LLM replica's engine needs.

    ``num_kv_blocks=None`` derives the pool size: on CUDA from ``kv_cache_memory_fraction`` of the free
    GPU memory after the weights are loaded; on CPU enough blocks for ``max_num_seqs`` sequences of
    ``min(max_model_len, 2048)`` tokens, capped at 1 GiB of KV cache.
    """

    model: str
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: int = 4096
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.8
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    seed: int = 0
    # Hybrid (linear-attention) models: sequences whose states the state cache holds at once, each
    # slot the conv + recurrent states of every linear layer (None: max_num_seqs). Its memory is
    # num_state_slots x the model's slot bytes, allocated at start; other models ignore it.
    num_state_slots: int | None = None
    # Hybrid models' prefix caching: slots for snapshots of those states at block boundaries (None:
    # as many as num_state_slots; 0 or enable_prefix_caching=False: no prefix caching for them).
    num_state_snapshots: int | None = None
    # ... and besides each prompt's end and a request's latest generated block, a snapshot every this
    # many blocks of a prompt (long shared prefixes); 0: none (README "Qwen3.5": the measured choice)
    snapshot_interval_blocks: int = 16
    # Models with sliding-window layers beside full ones (Gemma 3, Gemma 4): the window layers keep
    # their own blocks, only those their window still reads (``window_kv_cache_manager.py``); False:
    # one block table for every layer, blocks held for the whole context (the comparison)
    sliding_window_blocks: bool = True
    # E/P/D decode replicas: host memory for the KV of preempted requests that cannot recompute
    # (their media's embeddings are not here: llm_service/kv_swap.py), in MiB; None: the KV cache's
    # own size. A preempted request whose copy would pass it ends with a retryable 503 instead.
    kv_swap_space_mib: float | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_model_len <= 0:
            raise ValueError("block_size and max_model_len must be positive")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError("num_kv_blocks must be positive when set")
        if self.num_state_slots is not None and self.num_state_slots <= 0:
            raise ValueError("num_state_slots must be positive when set")
        if self.num_state_snapshots is not None and self.num_state_snapshots < 0:
            raise ValueError("num_state_snapshots must not be negative")
        if self.snapshot_interval_blocks < 0:
            raise ValueError("snapshot_interval_blocks must not be negative")
        if self.kv_swap_space_mib is not None and self.kv_swap_space_mib < 0:
            raise ValueError("kv_swap_space_mib must not be negative")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, not {self.dtype!r}")
