"""The ingress's Prometheus metrics (through Ray's metrics agent, scraped per node).

Each served model gets its own ``RequestMetrics``, every metric in it bound to the model's labels
once, so an observation builds no label map.
"""

from __future__ import annotations

from collections.abc import Iterable

from encoder_service.serve.metrics import stage

BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
# inter-token latency: 1 ms (a small model on a GPU) to 1 s
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1]


class RequestMetrics:
    """One model's request latencies at the ingress."""

    def __init__(self, model: str) -> None:
        from ray.serve import metrics

        def histogram(name: str, doc: str, buckets: list[float]) -> metrics.Histogram:
            hist = metrics.Histogram(name, doc, buckets, ("model",))
            hist.set_default_tags({"model": model})  # Serve's returns None, not the metric
            return hist

        self.ttft = histogram("mmserve_ttft_seconds", "time to first token", BUCKETS)
        self.tpot = histogram(
            "mmserve_time_per_output_token_seconds", "end-to-end time / output tokens", BUCKETS
        )
        self.e2e = histogram("mmserve_e2e_latency_seconds", "request latency", BUCKETS)
        self.itl = histogram(
            "mmserve_inter_token_latency_seconds",
            "a request's mean time between output tokens after the first",
            ITL_BUCKETS,
        )
        # a media request, from the ingress's side: the hit path or the prepare call, until its
        # prompt ids and embedding refs are in hand
        self.prepare = stage(model, "ingress", "prepare")

    def done(self, start: float, first_at: float, end: float, completion_tokens: int) -> None:
        e2e = end - start
        self.e2e.observe(e2e)
        if completion_tokens > 1:
            self.tpot.observe(e2e / completion_tokens)
            self.itl.observe((end - first_at) / (completion_tokens - 1))


class IngressMetrics:
    def __init__(self, models: Iterable[str] = ()) -> None:
        from ray.serve import metrics

        self.rejected = metrics.Counter("mmserve_requests_rejected", "requests refused", ("model", "reason"))
        self._models = {name: RequestMetrics(name) for name in models}

    def model(self, name: str) -> RequestMetrics:
        found = self._models.get(name)
        if found is None:
            found = self._models[name] = RequestMetrics(name)
        return found
