"""An E/P/D model's LLM pools: each pool's role, Serve options and own engine settings over the model's
``llm`` (``LLMPoolEngine``), and the settings both pools must share because the KV moves between them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from cluster.serve_options import DeploymentOptions
from cluster.serve_options import StrictModel as _Strict

# An LLM pool's deployment is named `<prefix>-<model>` by its role (cluster/replicas.py's classes).
LLM_DEPLOYMENT_PREFIX = {"both": "LLMServer", "prefill": "LLMPrefillServer", "decode": "LLMDecodeServer"}


class LLMPoolEngine(_Strict):
    """An E/P/D pool's own engine settings, over the model's ``llm`` ones: what each instance may size
    for its role (vLLM and SGLang take separate server args per prefill and decode instance). Unset
    (or null): the ``llm`` value. What the moved KV must agree on (dtype, block size, max_model_len,
    the block layout, prefix caching, the hand-off protocol) is not here: ``POOL_SHARED_FIELDS``."""

    num_kv_blocks: int | None = Field(None, ge=1, description="KV blocks per replica of this pool")
    kv_cache_memory_fraction: float | None = Field(None, gt=0, le=1)
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(
        None, ge=16, description="tokens per step, the prefill chunk's size (prefill pools: larger)"
    )
    num_state_slots: int | None = Field(None, ge=1)
    num_state_snapshots: int | None = Field(None, ge=0)
    kv_swap_space_mib: float | None = Field(None, ge=0, description="decode pools only")
    max_waiting_requests: int | None = Field(None, ge=1)
    max_waiting_tokens: int | None = Field(None, ge=1)
    torch_threads: int | None = Field(None, ge=1)


# ``llm`` settings one E/P/D pool may not set apart from the other: the KV computed by a prefill replica
# is read by a decode replica, so both must lay it out, hash it and hand it off alike.
POOL_SHARED_FIELDS = frozenset(
    {
        "dtype",
        "device",
        "max_model_len",
        "block_size",
        "sliding_window_blocks",
        "snapshot_interval_blocks",
        "enable_prefix_caching",
        "embedding_fetch_timeout_s",
        "handoff_deadline_s",
        "kv_transfer_timeout_s",
        "kv_pull_chunks",
        "kv_transfer",
    }
)
# ``engine`` settings of one role only: a prefill replica never preempts a request it hands off.
POOL_ROLE_ONLY_FIELDS = {"kv_swap_space_mib": "decode"}


def refused_pool_engine_fields(model: str | None, pools: object) -> None:
    """A ``ValueError`` naming the model, the pool and the field where an ``llm.pools[].engine`` sets
    what both pools must share, or a setting of the other role (the raw config, before pydantic)."""
    if not isinstance(pools, list):
        return
    for pool in pools:
        engine = pool.get("engine") if isinstance(pool, dict) else None
        if not isinstance(engine, dict):
            continue
        role = pool.get("role")
        for field, value in engine.items():
            where = f"llm.pools[role={role}].engine.{field}"
            where = where if model is None else f"model {model!r}: {where}"
            if field in POOL_SHARED_FIELDS:
                raise ValueError(
                    f"{where}: must be the same in the prefill and decode pools (the KV moves between "
                    "them); set it under `llm`"
                )
            if value is not None and field in POOL_ROLE_ONLY_FIELDS and role != POOL_ROLE_ONLY_FIELDS[field]:
                raise ValueError(f"{where}: a {POOL_ROLE_ONLY_FIELDS[field]} pool's setting only")


class LLMPoolConfig(_Strict):
    """One LLM pool of an E/P/D model: its role, its Serve options and its own engine settings."""

    role: Literal["prefill", "decode"] = Field(
        ..., description="prefill: prompts and first tokens, KV handed off; decode: imported KV, the rest"
    )
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions)
    engine: LLMPoolEngine = Field(
        default_factory=LLMPoolEngine,
        description="this pool's own engine settings over `llm`'s (e.g. a decode pool with more KV blocks "
        "and sequences, a prefill pool with a larger max_num_batched_tokens); docs/disaggregation.md",
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_shared(cls, data: object) -> object:
        refused_pool_engine_fields(None, [data])
        return data
