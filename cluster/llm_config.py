"""A model's LLM section of the config (``LLMConfig``): the engine's settings, its Serve options, and
E/P/D's prefill and decode pools with how the KV moves between them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from cluster.pool_config import LLMPoolConfig
from cluster.serve_options import DeploymentOptions
from cluster.serve_options import StrictModel as _Strict


class LLMConfig(_Strict):
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int = Field(4096, ge=16)
    block_size: int = Field(16, ge=1)
    num_kv_blocks: int | None = Field(None, ge=1, description="KV blocks per replica; default from memory")
    kv_cache_memory_fraction: float = Field(0.8, gt=0, le=1)
    num_state_slots: int | None = Field(
        None,
        ge=1,
        description="hybrid (linear-attention) models: sequences' states held at once; default max_num_seqs",
    )
    num_state_snapshots: int | None = Field(
        None,
        ge=0,
        description="hybrid models' prefix caching: state snapshots kept at block boundaries; default num_state_slots",
    )
    sliding_window_blocks: bool = Field(
        True,
        description="sliding-window layers (Gemma 3/4) keep only the blocks their window reads; false: one block table for all",
    )
    snapshot_interval_blocks: int = Field(
        16,
        ge=0,
        description="hybrid models: besides prompt ends, a state snapshot every this many prompt blocks; 0: none",
    )
    kv_swap_space_mib: float | None = Field(
        None,
        ge=0,
        description="E/P/D decode replicas: host memory for preempted media requests' KV copies, MiB; "
        "default the KV cache's size; a copy past it ends its request with a retryable 503",
    )
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=16)
    enable_prefix_caching: bool = True
    embedding_fetch_timeout_s: float = Field(
        60.0, gt=0, description="an embedding not fetched from the object store by then counts as lost"
    )
    max_waiting_requests: int = Field(
        256, ge=1, description="requests queued in one replica's engine, not yet running; more: 503"
    )
    max_waiting_tokens: int | None = Field(
        None,
        ge=1,
        description="prompt tokens queued in one replica's engine; default max_waiting_requests x max_model_len",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads of each LLM replica's model; default: what Ray gives the "
        "replica's process (1 for a fractional num_cpus)",
    )
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions)
    pools: list[LLMPoolConfig] = Field(
        default_factory=list,
        description="E/P/D: the model's LLM pools by role, one `prefill` and one `decode`, each its own Serve "
        "deployment (resources, placement markers such as prefill_node/decode_node, autoscaling); empty: one "
        "pool of role `both` on `deployment` (docs/disaggregation.md)",
    )
    handoff_deadline_s: float = Field(
        30.0,
        gt=0,
        description="E/P/D: how long a prefill replica holds a request's KV for its decode replica",
    )
    kv_transfer_timeout_s: float = Field(
        10.0, gt=0, description="E/P/D: a decode replica's pull of a request's KV fails past this"
    )
    kv_pull_chunks: bool = Field(
        False,
        description="E/P/D: the prefill replica answers at once and the decode replica pulls the prompt's "
        "blocks chunk by chunk as they are computed, overlapping the transfer with the prefill "
        "(docs/disaggregation.md)",
    )

    kv_transfer: Literal["link", "collective"] = Field(
        "link",
        description="E/P/D: how a request's KV moves from the prefill to the decode replica: `link`, over their "
        "authenticated direct link (host bytes); `collective`, on a torch.distributed group the pair forms "
        "(NCCL between CUDA caches, gloo on CPU), straight between the paged caches; unauthenticated and "
        "unencrypted: a trusted cluster network only (docs/disaggregation.md)",
    )

    @model_validator(mode="after")
    def _check_pools(self) -> LLMConfig:
        roles = sorted(p.role for p in self.pools)
        if roles and roles != ["decode", "prefill"]:
            raise ValueError(f"llm.pools: one `prefill` and one `decode` pool (or none), got roles {roles}")
        if self.kv_transfer == "collective" and not self.pools:
            raise ValueError(
                "llm.kv_transfer: `collective` moves KV between a prefill and a decode pool; this model has "
                "one LLM pool (set llm.pools, or leave kv_transfer at `link`)"
            )
        if self.kv_transfer == "collective" and self.kv_pull_chunks:
            raise ValueError(
                "llm.kv_transfer: `collective` does not take llm.kv_pull_chunks (the chunks' pulls go over "
                "the link); set one of them"
            )
        return self

    def for_role(self, role: str) -> LLMConfig:
        """The engine settings of the model's pool of ``role``: ``llm``'s, with that pool's ``engine``
        overrides (``both``: ``llm``'s as they are)."""
        for p in self.pools:
            if p.role == role:
                return self.model_copy(update=p.engine.model_dump(exclude_none=True))
        if role == "both" and not self.pools:
            return self
        raise KeyError(f"no LLM pool of role {role!r}")

    def pool(self, role: str) -> DeploymentOptions:
        """The Serve options of the model's pool of ``role`` (``both``: ``deployment``)."""
        for p in self.pools:
            if p.role == role:
                return p.deployment
        if role == "both" and not self.pools:
            return self.deployment
        raise KeyError(f"no LLM pool of role {role!r}")

    @property
    def roles(self) -> list[str]:
        """The model's LLM pools by role: ``["both"]``, or ``["prefill", "decode"]`` (E/P/D)."""
        return ["prefill", "decode"] if self.pools else ["both"]
