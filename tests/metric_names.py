"""The Prometheus metrics mmserve exports, as a scrape of Ray's metrics port names them: the e2e
metrics test (tests/integration/e2e/test_metrics.py) asserts every one is in the scrape
after its requests, and the dashboard test (tests/unit/cluster/deploy/test_grafana_dashboard.py) that every
dashboard query names one of them. One list, read by both."""

from __future__ import annotations

# (pool, stage) of every series of ray_mmserve_stage_seconds
STAGES = (
    ("ingress", "prepare"),
    ("ingress", "cache_lookup"),
    ("encoder", "fetch"),
    ("encoder", "cache_lookup"),
    ("encoder", "cache_wait"),
    ("encoder", "media_decode"),
    ("encoder", "preprocess"),
    ("encoder", "encoder_queue"),
    ("encoder", "encode"),
    ("llm", "llm_queue"),
    ("llm", "prefill"),
    ("llm", "decode"),
    ("llm", "engine_step"),
)

# metric families (a histogram's name, without _bucket/_count/_sum; a counter's with _total)
EXPORTED = (
    "ray_mmserve_stage_seconds",
    "ray_mmserve_ttft_seconds",
    "ray_mmserve_inter_token_latency_seconds",
    "ray_mmserve_time_per_output_token_seconds",
    "ray_mmserve_e2e_latency_seconds",
    "ray_mmserve_requests_rejected_total",
    "ray_mmserve_encoder_cache_lookups_total",
    "ray_mmserve_encoder_queued_embeddings",
    "ray_mmserve_encoder_items_total",
    "ray_mmserve_encoder_embeddings_total",
    "ray_mmserve_kv_blocks_in_use",
    "ray_mmserve_kv_usage",
    "ray_mmserve_llm_running_requests",
    "ray_mmserve_llm_waiting_requests",
    "ray_mmserve_prefix_cache_hit_tokens_total",
    "ray_mmserve_prefix_cache_query_tokens_total",
    "ray_mmserve_generated_tokens_total",
    "ray_mmserve_step_cpu_seconds_total",
    "ray_mmserve_step_wall_seconds_total",
    "ray_serve_deployment_replica_healthy",
)
