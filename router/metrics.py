"""The ingress's Prometheus metrics (through Ray's metrics agent, scraped per node)."""

from __future__ import annotations


class IngressMetrics:
    def __init__(self) -> None:
        from ray.serve import metrics

        buckets = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
        self.ttft = metrics.Histogram("mmserve_ttft_seconds", "time to first token", buckets, ("model",))
        self.tpot = metrics.Histogram(
            "mmserve_time_per_output_token_seconds", "end-to-end time / output tokens", buckets, ("model",)
        )
        self.e2e = metrics.Histogram("mmserve_e2e_latency_seconds", "request latency", buckets, ("model",))
        self.rejected = metrics.Counter("mmserve_requests_rejected", "requests refused", ("model", "reason"))
