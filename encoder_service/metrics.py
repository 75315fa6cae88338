"""The encoder pool's Prometheus metrics (through Ray's metrics agent, scraped per node)."""

from __future__ import annotations


class EncoderMetrics:
    def __init__(self, model: str) -> None:
        from ray.serve import metrics

        tags = {"model": model}
        self.queued = metrics.Gauge("mmserve_encoder_queued_embeddings", "embeddings waiting", ("model",))
        self.queued.set_default_tags(dict(tags))
        self.items = metrics.Counter("mmserve_encoder_items", "media items encoded", ("model",))
        self.items.set_default_tags(dict(tags))
        self.embeddings = metrics.Counter("mmserve_encoder_embeddings", "embeddings computed", ("model",))
        self.embeddings.set_default_tags(dict(tags))
