"""The deployable replica classes, one per pool, each named as its Serve deployment is::

    IngressServer                  router/http/app.py's, given its config (HTTP, models, admission, keys)
    EncoderServer-<model>          encoder_service/serve/deployment.py's, given its config and a link server
    LLMServer-<model>              llm_service/serve/deployment.py's, given its config and a link server
    LLMPrefillServer-<model>       E/P/D: the same of role prefill (+ ``prefill``, ``pull_kv`` on its link)
    LLMDecodeServer-<model>        E/P/D: the same of role decode (links to the prefill replicas: kv_links)
    EncoderCacheIndex-<model>      cluster/cache_shards.py (the owner of the model's cache shards)

Each subclasses the service's class of the same name (imported by module, so the name is one) and adds
only what the wiring knows: reading the ``AppConfig`` on the replica (its node resolves the model's
files), tracing, and the direct link's server (cluster/replica_links.py). Its metrics carry Serve's
``deployment`` tag (the name above) and the pool's own ``pool`` label (``ingress``, ``encoder``,
``llm``), as its logger is ``mmserve.<pool>``. cluster/app.py builds the application from them.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable
from typing import TYPE_CHECKING, ClassVar

from ray import serve

from cluster.budgets import encoder_budgets
from cluster.cache_shards import cache_index_args, open_cache_index
from cluster.config import AppConfig, DeploymentOptions, ModelConfig
from cluster.cpu_affinity import pin_replica, process_cpus
from cluster.model_dirs import resolve_model_dir
from cluster.replica_links import DirectLLM, DirectServed, kv_links, pool_links
from cluster.tracing import setup_tracing
from encoder_service.serve import deployment as encoder_serve
from llm_service.serve import deployment as llm_serve
from router.http import app as http_app

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from encoder_service.preprocess.make_preparer import PreprocessArgs
    from llm_service.request_spec import ReplicaTarget
    from router.http.auth import KeyRing


def preprocess_args(m: ModelConfig) -> PreprocessArgs:
    """What preparing a model's requests takes from its config (an encoder replica, and the ingress's
    hit path)."""
    from encoder_service.preprocess.media.limits import MediaLimits

    return {
        "limits": MediaLimits(**m.preprocess.media.model_dump()),
        "limit_mm_per_prompt": dict(m.preprocess.limit_mm_per_prompt),
        "processor_cache_bytes": m.preprocess.processor_cache_bytes,
        "chat_template": m.chat_template,
    }


def direct_pools(cfg: AppConfig, model: ModelConfig) -> tuple[str, ...]:
    """The model's pools the ingress calls over direct links (``ingress.transport: auto``), however
    many replicas they run: mmcore/link/pool_links.py routes each call as the pool's Serve router would."""
    if cfg.ingress.transport != "auto":
        return ()
    return ("llm", "encoder")


def model_modalities(model_dir: str) -> list[str]:
    """What the model's family takes (image, video, audio), from the family registry."""
    import json
    from pathlib import Path

    from encoder_service.families import encoder_family

    model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    return list(encoder_family(model_type, model_dir).modalities)


def model_tool_format(m: ModelConfig, model_dir: str) -> str:
    """How the model writes tool calls: its ``tool_call_parser``, else its family's (the registry)."""
    if m.tool_call_parser is not None:
        return m.tool_call_parser
    import json
    from pathlib import Path

    from llm_service.models.families import decoder_family

    model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    return decoder_family(model_type, model_dir).tool_format


def model_reasoning_format(m: ModelConfig, model_dir: str) -> str | None:
    """The model's reasoning parser: its ``reasoning_parser`` (``auto``: its family's line), else none."""
    if m.reasoning_parser != "auto":
        return m.reasoning_parser
    import json
    from pathlib import Path

    from llm_service.models.families import decoder_family

    model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    fmt = decoder_family(model_type, model_dir).reasoning_format
    if fmt is None:
        raise ValueError(f"model {m.name!r}: reasoning_parser auto, but its family has no reasoning format")
    return fmt


def pin_to_pool_cores(opts: DeploymentOptions) -> None:
    """The pool's ``cpu_affinity`` on every thread of this replica's process (cluster/cpu_affinity.py),
    before the model is built: the threads torch starts later inherit it."""
    if opts.cpu_affinity is not None:
        ctx = serve.get_replica_context()
        pin_replica(opts.cpu_affinity, f"deployment {ctx.deployment}", f"{ctx.app_name}.{ctx.deployment}")


class EncoderServer(encoder_serve.EncoderServer, DirectServed):
    """The encoder pool's replica: ``prepare`` and ``prepare_stream`` also over its direct link."""

    DIRECT_METHODS: ClassVar[dict[str, str]] = {"prepare": "prepare", "prepare_stream": "prepare_stream"}
    REF_STREAMS = frozenset({"prepare_stream"})  # its items hold the embeddings' refs

    def __init__(
        self, model_json: dict[str, object], cache_dir: str, cache_index: DeploymentHandle, links: bool
    ) -> None:
        setup_tracing("encoder")  # cluster/tracing.py: only if OTEL_* asks for it
        self.links_on = links
        self.refuse_plain_off_loopback()
        m = ModelConfig.model_validate(model_json)
        d = m.encoder.deployment
        pin_to_pool_cores(d)
        model_dir = resolve_model_dir(m, cache_dir)
        compute_budget, _ = encoder_budgets(m, model_dir)
        super().__init__(
            model_dir,
            **preprocess_args(m),
            tp_size=m.encoder.mm_encoder_tp_size,
            tp_mode=m.encoder.mm_encoder_tp_mode,
            dtype=m.encoder.dtype,
            device=m.encoder.device,
            max_num_encoder_input_tokens=compute_budget,
            num_cpus_per_rank=d.num_cpus,
            num_gpus_per_rank=d.num_gpus,
            resources_per_rank=dict(d.resources),
            model_name=m.name,
            cache=open_cache_index(
                *cache_index_args(m), links=links, uuid_names_per_tenant=m.encoder.uuid_names_per_tenant
            ),
            max_queued_embeddings=m.encoder.max_queued_embeddings or 16 * compute_budget,
            step_embeds=m.encoder.encoder_step_embeds,
            torch_threads=m.encoder.torch_threads,
        )

    # Serve awaits either form; async here to start the link's listener on the first call.
    async def record_routing_stats(self) -> dict[str, object]:  # type: ignore[override]
        return {**super().record_routing_stats(), **await self.link_stats()}

    def stats(self) -> dict[str, object]:
        replica = str(serve.get_replica_context().replica_id.unique_id)
        return {
            **super().stats(),
            "link_calls": self.link_calls(),
            "replica_id": replica,
            "cpu_affinity": process_cpus(),
        }

    # Serve's shutdown hook: refuse new frames, then drain the FIFO
    def __del__(self) -> Awaitable[int] | None:
        self.drain_link()
        return super().__del__()


class LLMServer(llm_serve.LLMServer, DirectLLM):
    """The LLM pool's replica: ``submit``, ``abort``, ``arrived`` and its output channel also over its
    direct link. ``ROLE``: ``both``, or E/P/D's (``LLMPrefillServer``, ``LLMDecodeServer``)."""

    ROLE = "both"

    def __init__(self, model_json: dict[str, object], cache_dir: str, links: bool) -> None:
        from llm_service.config import EngineConfig

        setup_tracing("llm")
        self.links_on = links
        self.refuse_plain_off_loopback()
        m = ModelConfig.model_validate(model_json)
        llm = m.llm.for_role(self.ROLE)  # E/P/D: the pool's own engine settings over llm's
        pin_to_pool_cores(llm.pool(self.ROLE))
        engine_config = EngineConfig(
            model=resolve_model_dir(m, cache_dir),
            dtype=llm.dtype,
            device=llm.device,
            max_model_len=llm.max_model_len,
            block_size=llm.block_size,
            num_kv_blocks=llm.num_kv_blocks,
            kv_cache_memory_fraction=llm.kv_cache_memory_fraction,
            num_state_slots=llm.num_state_slots,
            num_state_snapshots=llm.num_state_snapshots,
            snapshot_interval_blocks=llm.snapshot_interval_blocks,
            kv_swap_space_mib=llm.kv_swap_space_mib,
            sliding_window_blocks=llm.sliding_window_blocks,
            max_num_seqs=llm.max_num_seqs,
            max_num_batched_tokens=llm.max_num_batched_tokens,
            enable_prefix_caching=llm.enable_prefix_caching,
        )
        if llm.torch_threads is not None:  # before the model is built: the step's forward uses it
            import torch

            torch.set_num_threads(llm.torch_threads)
        super().__init__(
            engine_config,
            m.name,
            embedding_fetch_timeout_s=llm.embedding_fetch_timeout_s,
            max_waiting_requests=llm.max_waiting_requests,
            max_waiting_tokens=llm.max_waiting_tokens or llm.max_waiting_requests * llm.max_model_len,
            role=self.ROLE,
            handoff=None
            if self.ROLE == "both"
            else llm_serve.HandoffWiring(
                self.direct_address,
                kv_links(),
                llm.handoff_deadline_s,
                llm.kv_transfer_timeout_s,
                llm.kv_pull_chunks,
                llm.kv_transfer,
            ),
        )

    # Serve awaits either form; async here to start the link's listener on the first call.
    async def record_routing_stats(self) -> dict[str, object]:  # type: ignore[override]
        return {**super().record_routing_stats(), **await self.link_stats()}

    def stats(self, target: ReplicaTarget | None = None) -> dict[str, object]:
        return {
            **super().stats(target),
            "link_calls": self.link_calls(),
            "link_channel_batches": self.linked_channel_batches,
            "cpu_affinity": process_cpus(),  # the cores its threads may use (deployment.cpu_affinity)
        }


class LLMPrefillServer(LLMServer):
    """E/P/D's prefill pool: ``prefill`` (prompt, first token, the KV held) and ``pull_kv`` (a decode
    replica's pull of it), both over its direct link (llm_service/serve/handoff.py)."""

    ROLE = "prefill"
    DIRECT_METHODS: ClassVar[dict[str, str]] = {
        **LLMServer.DIRECT_METHODS,
        "prefill": "prefill",
        "pull_kv": "pull_kv",
        "pull_kv_chunks": "pull_kv_chunks",
        "kv_pair_join": "kv_pair_join",  # llm.kv_transfer: collective (llm_service/serve/kv_pair.py)
        "kv_send": "kv_send",
    }


class LLMDecodeServer(LLMServer):
    """E/P/D's decode pool: ``submit`` of a handed-off request imports its KV from the prefill replica
    that holds it, then streams its tokens as any LLM replica does."""

    ROLE = "decode"


class IngressServer(http_app.IngressServer):
    """The ingress replica: the OpenAI routes over every model's pools."""

    # @serve.ingress made the parent's __init__ async: a subclass must await it.
    async def __init__(  # type: ignore[misc]
        self, config_json: dict[str, object], pools: dict[str, dict[str, DeploymentHandle]]
    ) -> None:
        from router.http.listener import ConnectionLimits
        from router.protocol.messages import MessageLimits
        from router.routing.admission import AdmissionLimits

        setup_tracing("ingress")
        cfg = AppConfig.model_validate(config_json)
        pin_to_pool_cores(cfg.ingress.deployment)
        models = []
        for m in cfg.models:
            model_dir = resolve_model_dir(m, cfg.models_cache_dir)
            limits = MessageLimits(
                max_messages=cfg.ingress.max_messages,
                max_content_parts=cfg.ingress.max_content_parts,
                max_media_bytes=m.preprocess.media.max_bytes,
                limit_mm_per_prompt=dict(m.preprocess.limit_mm_per_prompt),
            )
            models.append(
                http_app.IngressModel(
                    m.name,
                    model_dir,
                    m.llm.block_size,
                    m.llm.max_model_len,
                    limits,
                    model_modalities(model_dir),
                    open_cache_index(
                        *cache_index_args(m),
                        links=cfg.ingress.transport == "auto",
                        uuid_names_per_tenant=m.encoder.uuid_names_per_tenant,
                    ),
                    preprocess_args(m),
                    m.preprocess.hit_path_cache_entries,
                    m.preprocess.hit_path_cache_ttl_s,
                    direct=direct_pools(cfg, m),
                    # each link call's deadline: the request's own, not the link's 300 s default
                    link_to=functools.partial(pool_links, timeout_s=cfg.ingress.request_timeout_s),
                    overlap_prefill=m.preprocess.overlap_prefill,
                    tool_format=model_tool_format(m, model_dir),
                    reasoning_format=model_reasoning_format(m, model_dir),
                    chat_template=m.chat_template,
                )
            )
        ing = cfg.ingress
        http = http_app.HTTPOptions(
            ing.http_mode,
            cfg.host,
            cfg.port,
            ing.max_request_bytes,
            ing.deployment.graceful_shutdown_timeout_s,
            max_json_values=ing.max_json_values,
            request_timeout_s=ing.request_timeout_s,
            connections=ConnectionLimits(ing.header_timeout_s, ing.max_header_bytes, ing.max_connections),
        )
        a = ing.admission
        admission = AdmissionLimits(
            a.max_concurrent_requests,
            a.max_concurrent_cost,
            dict(a.media_cost),
            a.text_chars_per_cost,
            a.retry_after_s,
            a.max_body_bytes_in_flight,
        )
        await super().__init__(models, pools, http, admission, keys=ingress_keys(cfg))  # type: ignore[misc]

    def replica_stats(self) -> dict[str, object]:
        return {
            "replica_id": str(serve.get_replica_context().replica_id.unique_id),
            "cpu_affinity": process_cpus(),  # the cores its threads may use (ingress.deployment.cpu_affinity)
        }


def ingress_keys(cfg: AppConfig) -> KeyRing:
    """The ingress replica's ``KeyRing``: ``ingress.api_key`` (or ``MMSERVE_API_KEY`` where the replica
    runs), ``ingress.api_keys_file`` (read here, on the replica's node: e.g. a mounted Secret) and
    ``ingress.operator_api_key`` (or ``MMSERVE_OPERATOR_API_KEY``)."""
    import os

    from router.http.auth import API_KEY_ENV, OPERATOR_KEY_ENV, KeyRing

    ing = cfg.ingress
    api_key = ing.api_key.get_secret_value() if ing.api_key is not None else os.environ.get(API_KEY_ENV)
    operator = ing.operator_api_key
    operator_key = operator.get_secret_value() if operator is not None else os.environ.get(OPERATOR_KEY_ENV)
    return KeyRing.from_sources(api_key or None, ing.api_keys_file, operator_key or None)
