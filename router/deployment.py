"""The Ingress Serve deployment: FastAPI routes over ChatService, one Orchestrator per model."""

import json
import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from router.errors import APIError, from_exception
from router.ingress import ChatService, ServedModel
from router.messages import MessageLimits
from router.orchestrator import ModelHandles, Orchestrator

logger = logging.getLogger("mmserve.ingress")

fastapi_app = FastAPI(title="mmserve", version="0.1.0")


@fastapi_app.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers())


def model_modalities(model_dir: str) -> list[str]:
    model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    return {"qwen2_vl": ["image", "video"], "qwen2_audio": ["audio"]}.get(model_type, [])


class _IngressMetrics:
    def __init__(self) -> None:
        from ray.serve import metrics

        buckets = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
        self.ttft = metrics.Histogram("mmserve_ttft_seconds", "time to first token", buckets, ("model",))
        self.tpot = metrics.Histogram(
            "mmserve_time_per_output_token_seconds", "end-to-end time / output tokens", buckets, ("model",)
        )
        self.e2e = metrics.Histogram("mmserve_e2e_latency_seconds", "request latency", buckets, ("model",))
        self.rejected = metrics.Counter("mmserve_requests_rejected", "requests refused", ("model", "reason"))


@serve.ingress(fastapi_app)
class IngressServer:
    def __init__(self, config: dict[str, Any], pools: dict[str, dict[str, Any]]) -> None:
        from transformers import AutoTokenizer

        from cluster.config import AppConfig
        from cluster.model_dirs import resolve_model_dir
        from router.deployment import cache_index_args, open_cache_index

        cfg = AppConfig.model_validate(config)
        self.metrics = _IngressMetrics()
        self.encoder_items_dispatched: dict[str, int] = {}
        models: dict[str, ServedModel] = {}
        self.caches: dict[str, Any] = {}
        for m in cfg.models:
            model_dir = resolve_model_dir(m, cfg.models_cache_dir)
            cache = open_cache_index(*cache_index_args(m))
            self.caches[m.name] = cache
            handles = ModelHandles(
                pools[m.name]["preprocess"], pools[m.name]["encoder"], pools[m.name]["llm"], cache
            )
            self.encoder_items_dispatched[m.name] = 0
            orch = Orchestrator(
                handles,
                AutoTokenizer.from_pretrained(model_dir),
                m.llm.block_size,
                m.llm.max_model_len,
                on_encoder_run=self._counter(m.name),
            )
            limits = MessageLimits(
                max_messages=cfg.ingress.max_messages,
                max_content_parts=cfg.ingress.max_content_parts,
                max_media_bytes=m.preprocess.media.max_bytes,
                limit_mm_per_prompt=dict(m.preprocess.limit_mm_per_prompt),
            )
            models[m.name] = ServedModel(
                m.name, orch, limits, m.llm.max_model_len, model_modalities(model_dir)
            )
        self.service = ChatService(models, cfg.ingress.max_request_bytes, self.metrics)

    def _counter(self, model: str) -> Any:
        def bump(n: int) -> None:
            self.encoder_items_dispatched[model] += n

        return bump

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        try:
            return await self.service.chat(request)
        except Exception as e:
            api = from_exception(e) or _server_error(e)
            if api.status_code >= 500 and api.code == "internal_error":
                logger.exception("request failed")
            self.metrics.rejected.inc(tags={"model": "-", "reason": api.code})
            return JSONResponse(api.body(), status_code=api.status_code, headers=api.headers())

    @fastapi_app.get("/v1/models")
    async def list_models(self) -> JSONResponse:
        return JSONResponse(self.service.model_list().model_dump())

    @fastapi_app.get("/health")
    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @fastapi_app.get("/stats")
    async def stats(self) -> JSONResponse:
        """Operator view: encoder-cache counters and encoder items dispatched, per model."""
        out = {}
        for name, cache in self.caches.items():
            out[name] = {
                "encoder_cache": await cache.stats(),
                "encoder_items_dispatched": self.encoder_items_dispatched[name],
            }
        return JSONResponse(out)


def open_cache_index(name_prefix: str, num_shards: int, capacity: int) -> Any:
    """The model's shared encoder-cache index: detached named actors, created by whoever comes first."""
    from encoder_service.cache_index import create_cache_index

    return create_cache_index(num_shards, capacity, name_prefix, detached=True, namespace="mmserve")


def cache_index_args(m: Any) -> tuple[str, int, int]:
    """(name prefix, shards, capacity in embeddings) of a model's shared encoder cache."""
    from cluster.budgets import encoder_budgets

    _, cache_size = encoder_budgets(m)
    return (f"mmserve-encoder-cache-{m.name}", m.encoder.cache_index_shards, cache_size)


def _server_error(e: BaseException) -> APIError:
    name = type(e).__name__
    if name in ("BackPressureError", "RayServeBackPressureError"):
        return APIError(503, "the server is at capacity; retry later", code="overloaded", retry_after_s=1)
    return APIError(500, "internal server error", code="internal_error")
