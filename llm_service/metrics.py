"""The LLM replica's Prometheus metrics (through Ray's metrics agent, scraped per node)."""

from __future__ import annotations

from typing import Any

from llm_service.outputs import RequestOutput


class LLMMetrics:
    """Prometheus metrics through Ray (scraped from each node's metrics port)."""

    def __init__(self, model: str) -> None:
        from ray.serve import metrics

        tags = {"model": model}
        self.kv_blocks_in_use = metrics.Gauge(
            "mmserve_kv_blocks_in_use", "KV blocks held by requests", ("model",)
        )
        self.kv_blocks_in_use.set_default_tags(dict(tags))
        self.running = metrics.Gauge(
            "mmserve_llm_running_requests", "requests in the running batch", ("model",)
        )
        self.running.set_default_tags(dict(tags))
        self.waiting = metrics.Gauge("mmserve_llm_waiting_requests", "requests waiting for KV", ("model",))
        self.waiting.set_default_tags(dict(tags))
        self.prefix_hit = metrics.Counter(
            "mmserve_prefix_cache_hit_tokens", "prompt tokens served from KV", ("model",)
        )
        self.prefix_hit.set_default_tags(dict(tags))
        self.prefix_query = metrics.Counter(
            "mmserve_prefix_cache_query_tokens", "prompt tokens looked up", ("model",)
        )
        self.prefix_query.set_default_tags(dict(tags))
        self.tokens = metrics.Counter("mmserve_generated_tokens", "generated tokens", ("model",))
        self.tokens.set_default_tags(dict(tags))

    def observe_step(self, outputs: list[RequestOutput]) -> None:
        """Tokens the engine generated, whether or not a caller still listens (an un-aborted request
        shows up here)."""
        n = sum(len(out.new_token_ids) for out in outputs)
        if n:
            self.tokens.inc(n)

    def export(self, stats: dict[str, Any]) -> None:
        self.kv_blocks_in_use.set(stats["num_total_blocks"] - stats["num_free_blocks"])
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        last = getattr(self, "_last", {"prefix_hit_tokens": 0, "prefix_query_tokens": 0})
        hit = stats["prefix_hit_tokens"] - last["prefix_hit_tokens"]
        query = stats["prefix_query_tokens"] - last["prefix_query_tokens"]
        if hit > 0:
            self.prefix_hit.inc(hit)
        if query > 0:
            self.prefix_query.inc(query)
        self._last = stats
