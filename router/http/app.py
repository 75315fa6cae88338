"""The ingress replica (``IngressServer``): OpenAI routes over ChatService, one Orchestrator per model.

HTTP arrives either through Serve's proxy (``@serve.ingress``: the mode for clusters whose load
balancer targets the proxy) or directly (``http_mode="direct"``: the replica runs its own server on
the user's port, see listener.py). cluster/app.py builds the ``IngressModel`` list; nothing here
reads the app config.
"""

# No ``from __future__ import annotations`` here: ``@serve.ingress`` pickles this class by value, and
# FastAPI must resolve the routes' annotations (``request: Request``) as objects, not as strings.
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from ray import serve

from mmcore.link.pool_links import PoolLinks
from router.http.auth import KeyRing
from router.http.chat import ChatService, ServedModel
from router.http.completions import CompletionService
from router.http.json_limits import DEFAULT_MAX_JSON_VALUES
from router.http.listener import ConnectionLimits, DirectHTTPServer
from router.http.metrics import IngressMetrics
from router.http.responses import ResponsesService
from router.journey.llm_client import LLMClient
from router.journey.model_handles import ModelHandles
from router.journey.orchestrator import ChatTokenizer, Orchestrator, chat_tokenizer
from router.journey.pd_client import PDClient
from router.protocol.errors import APIError, from_exception
from router.protocol.messages import MessageLimits
from router.routing.admission import AdmissionController, AdmissionLimits

if TYPE_CHECKING:  # annotations only (strings: this module has no ``from __future__ import annotations``)
    from ray.serve.handle import DeploymentHandle

    from encoder_service.cache.cache_client import EncoderCacheClient
    from encoder_service.preprocess.make_preparer import PreprocessArgs
    from encoder_service.preprocess.prepare import RequestPreparer

logger = logging.getLogger("mmserve.ingress")

fastapi_app = FastAPI(title="mmserve", version="0.1.0")


@fastapi_app.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers())


@dataclass(frozen=True)
class IngressModel:
    """What the ingress needs to serve one model (built by cluster/app.py from the AppConfig)."""

    name: str
    model_dir: str
    block_size: int
    max_model_len: int
    limits: MessageLimits
    modalities: list[str]
    cache: "EncoderCacheClient"  # the model's shared encoder cache
    # the hit path's make_preparer keywords (cluster.replicas.preprocess_args); None: off
    preprocess: "PreprocessArgs | None" = None
    near_cache_entries: int = 0  # the hit path's near cache (encoder_service/cache/near_cache.py); 0: none
    near_cache_ttl_s: float = 0.0
    direct: tuple[
        str, ...
    ] = ()  # pools ("llm", "encoder") called over direct links (mmcore/link/pool_links.py)
    link_to: Callable[["DeploymentHandle"], PoolLinks] | None = None  # cluster/replica_links.py
    overlap_prefill: bool = False  # items handed to the LLM as they are encoded (Orchestrator)
    tool_format: str = (
        "hermes"  # how the model writes tool calls (its family's line in llm_service/models/families.py)
    )
    chat_template: str | None = None  # the model's override of its checkpoint's template (its text)
    reasoning_format: str | None = None  # its reasoning parser (llm_service/tools/reasoning.py); None: off


@dataclass(frozen=True)
class HTTPOptions:
    mode: str  # "direct" | "proxy"
    host: str
    port: int
    max_request_bytes: int
    drain_timeout_s: float = 30.0  # shutdown: how long in-flight HTTP responses may take to finish
    max_json_values: int = DEFAULT_MAX_JSON_VALUES
    request_timeout_s: float | None = None  # end to end, router/journey/deadline.py
    # direct mode: slowloris bounds (listener.py)
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)


def _link(m: IngressModel, pool: str, handle: "DeploymentHandle") -> PoolLinks | None:
    """``PoolLinks`` to the replicas behind ``handle`` if ``pool`` is called directly; else None."""
    if pool not in m.direct:
        return None
    if m.link_to is None:
        raise ValueError(f"model {m.name}: pools {m.direct} are called directly but no link_to is given")
    return m.link_to(handle)


def _llm_client(m: IngressModel, pools: dict[str, "DeploymentHandle"]) -> LLMClient:
    """The model's LLM pool as the journey calls it: one pool (``llm``), or E/P/D's two (``prefill``,
    ``decode``: router/journey/pd_client.py)."""
    if "decode" not in pools:
        return LLMClient(pools["llm"], links=_link(m, "llm", pools["llm"]))
    prefill, decode = pools["prefill"], pools["decode"]
    return PDClient(prefill, decode, _link(m, "llm", prefill), _link(m, "llm", decode))


def _hit_path(m: IngressModel, tokenizer: ChatTokenizer) -> "RequestPreparer | None":
    """A ``RequestPreparer`` that never encodes: the Orchestrator's hit path (its misses go on to
    ``prepare`` with what it looked up). It renders prompts with ``tokenizer``, the Orchestrator's
    own, and the model's ``HitPathFacts``: no HF processor is loaded here."""
    if m.preprocess is None:
        return None
    from encoder_service.preprocess.make_preparer import make_preparer

    async def no_encode(batch: object) -> NoReturn:
        raise RuntimeError("the ingress's hit path encodes nothing")

    from encoder_service.cache.near_cache import NearCache
    from encoder_service.serve.metrics import media_stages

    preparer = make_preparer(
        m.model_dir,
        limits=m.preprocess["limits"],
        limit_mm_per_prompt=m.preprocess["limit_mm_per_prompt"],
        processor_cache_bytes=0,  # it processes nothing either
        cache=m.cache,
        chat_template=m.chat_template,  # it renders prompts: as the encoder's and the tokenizer's
        encode=no_encode,
        tokenizer=tokenizer,  # type: ignore[arg-type]  # a transformers tokenizer is both
        model_name=m.name,
        stages=media_stages(m.name, "ingress"),
    )
    if m.near_cache_entries > 0:
        preparer.near = NearCache(m.near_cache_entries, m.near_cache_ttl_s)
    return preparer


# Defined above the class: @serve.ingress pickles it by value, and its methods see only the module
# globals that exist at that point (one defined below the class is a NameError inside the replica).
def _server_error(e: BaseException) -> APIError:
    name = type(e).__name__
    if name in ("BackPressureError", "RayServeBackPressureError"):
        return APIError(503, "the server is at capacity; retry later", code="overloaded", retry_after_s=1)
    return APIError(500, "internal server error", code="internal_error")


@serve.ingress(fastapi_app)
class IngressServer:
    def __init__(
        self,
        models: list[IngressModel],
        pools: dict[str, dict[str, "DeploymentHandle"]],  # model -> "encoder" and "llm" pools
        http: HTTPOptions,
        admission: AdmissionLimits | None = None,
        keys: KeyRing | None = None,
    ) -> None:
        self.keys = keys or KeyRing()  # API keys -> tenants; every route but /health checks them

        self.metrics = IngressMetrics(m.name for m in models)
        self.encoder_items_dispatched: dict[str, int] = {}
        self.caches: dict[str, EncoderCacheClient] = {}
        from router.http.app import (
            _hit_path,
            _link,
            _llm_client,
        )  # pickled by value: see build_direct_app below

        served: dict[str, ServedModel] = {}
        for m in models:
            self.caches[m.name] = m.cache
            self.encoder_items_dispatched[m.name] = 0
            encoder = pools[m.name]["encoder"]
            tokenizer = chat_tokenizer(m.model_dir, m.chat_template)  # the override: as the encoder renders
            handles = ModelHandles(
                encoder,
                _llm_client(m, pools[m.name]),
                m.cache,
                _hit_path(m, tokenizer),
                encoder_links=_link(m, "encoder", encoder),
            )
            orch = Orchestrator(
                handles,
                tokenizer,
                m.block_size,
                m.max_model_len,
                on_encoder_run=self._counter(m.name),
                overlap_prefill=m.overlap_prefill,
            )
            served[m.name] = ServedModel(
                m.name, orch, m.limits, m.max_model_len, m.modalities, m.tool_format, m.reasoning_format
            )
        self.admission = AdmissionController(admission or AdmissionLimits())
        self.service = ChatService(
            served,
            http.max_request_bytes,
            self.metrics,
            self.admission,
            max_json_values=http.max_json_values,
            request_timeout_s=http.request_timeout_s,
        )
        self.completions_service = CompletionService(self.service)
        self.responses_service = ResponsesService(self.service)
        self.drain_timeout_s = http.drain_timeout_s
        self.http: DirectHTTPServer | None = None
        if http.mode == "direct":
            # Imported here: this class is pickled by value (``@serve.ingress`` wraps it), and its
            # methods see only the module globals captured then.
            from router.http.app import build_direct_app

            self.http = DirectHTTPServer(build_direct_app(self), http.host, http.port, http.connections)

    def _counter(self, model: str) -> Callable[[int], None]:
        def bump(n: int) -> None:
            self.encoder_items_dispatched[model] += n

        return bump

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        try:
            tenant = self.keys.authenticate(request.headers.get("authorization"))
            return await self.service.chat(request, tenant)
        except Exception as e:
            return self._refused(e)

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        """OpenAI's legacy text completions (router/http/completions.py): text prompts only."""
        try:
            tenant = self.keys.authenticate(request.headers.get("authorization"))
            return await self.completions_service.complete(request, tenant)
        except Exception as e:
            return self._refused(e)

    @fastapi_app.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API (router/http/responses.py), stateless."""
        try:
            tenant = self.keys.authenticate(request.headers.get("authorization"))
            return await self.responses_service.respond(request, tenant)
        except Exception as e:
            return self._refused(e)

    def _refused(self, e: Exception) -> JSONResponse:
        api = from_exception(e) or _server_error(e)
        if api.status_code >= 500 and api.code == "internal_error":
            logger.exception("request failed")
        self.metrics.rejected.inc(tags={"model": "-", "reason": api.code})
        return JSONResponse(api.body(), status_code=api.status_code, headers=api.headers())

    @fastapi_app.get("/v1/models")
    async def list_models(self, request: Request) -> JSONResponse:
        self.keys.authenticate(request.headers.get("authorization"))
        return JSONResponse(self.service.model_list().model_dump())

    @fastapi_app.get("/health")
    async def health(self) -> JSONResponse:
        if self.admission.closed:  # draining: load balancers stop sending here
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def proxy_healthz(self) -> PlainTextResponse:
        """Serve's proxy health route, answered as the proxy answers it (``success``; 503 while draining):
        KubeRay's readiness probe on a worker pod runs ``wget -q -O- localhost:<serve port>/-/healthz |
        grep success`` and its operator GETs the head's, so a pod whose ingress replica serves HTTP
        directly is Ready, and in the Kubernetes Service, exactly while that replica takes requests."""
        if self.admission.closed:
            return PlainTextResponse("draining", status_code=503)
        return PlainTextResponse("success")

    @fastapi_app.get("/stats")
    async def stats(self, request: Request) -> JSONResponse:
        """Operator view: encoder-cache counters and encoder items dispatched, per model;
        ``?pools=true`` adds the pools' own counters (``ModelHandles.pool_stats``). Counters across
        tenants: with API keys on, only the operator key sees them (router/http/auth.py)."""
        self.keys.authenticate_operator(request.headers.get("authorization"))
        pools = request.query_params.get("pools", "").lower() in ("1", "true", "yes")
        out = {}
        for name, cache in self.caches.items():
            orchestrator = self.service.models[name].orchestrator
            out[name] = {
                "encoder_cache": await cache.stats(),
                "encoder_items_dispatched": self.encoder_items_dispatched[name],
                # this ingress replica's hit path: media requests prepared without the prepare hop,
                # and its near cache (entries, hits, misses)
                **orchestrator.hit_path_stats(),
            }
            if pools:
                out[name]["pools"] = {
                    **await orchestrator.handles.pool_stats(),
                    "ingress_replica": self.replica_stats(),
                }
        return JSONResponse(out)

    def replica_stats(self) -> dict[str, object]:
        """This ingress replica's own entry in ``/stats?pools=true`` (``ingress_replica``), as the other
        pools' replicas report theirs; the wiring adds its id and ``cpu_affinity`` (cluster/replicas.py)."""
        return {}

    def check_health(self) -> None:
        if self.http is not None:
            self.http.check()

    async def __del__(self) -> None:
        """Serve's graceful shutdown (scale-down, redeploy, ``serve.shutdown``): refuse new requests
        (503 ``shutting_down``; /health answers 503), stop accepting connections, let the responses in
        flight finish (up to the pool's ``graceful_shutdown_timeout_s``). An ``async def`` on purpose:
        ``@serve.ingress``'s wrapper awaits a coroutine function but drops what a plain ``def`` returns.
        """
        admission = getattr(self, "admission", None)
        if admission is not None:
            admission.close()
        http = getattr(self, "http", None)
        if http is not None:
            await http.shutdown(getattr(self, "drain_timeout_s", 10.0))


def build_direct_app(server: IngressServer) -> FastAPI:
    """The same routes as ``fastapi_app``, bound to one replica, for the direct HTTP server."""
    app = FastAPI(title="mmserve", version="0.1.0")
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.chat_completions(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.completions(request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await server.responses(request)

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        return await server.list_models(request)

    @app.get("/health")
    async def health() -> JSONResponse:
        return await server.health()

    @app.get("/-/healthz")
    async def proxy_healthz() -> PlainTextResponse:
        return await server.proxy_healthz()

    @app.get("/stats")
    async def stats(request: Request) -> JSONResponse:
        return await server.stats(request)

    return app
