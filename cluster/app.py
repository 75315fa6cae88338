"""``build_app(config)``: the Ray Serve application — ingress plus, per model, two pools.

  Ingress ─┬─▶ EncoderPool-<model>  (GPU; prepares its requests; router: fewest queued embeddings)
           └─▶ LLMServer-<model>    (GPU; router: prefix-cache affinity; tokens back on output channels)
  plus the model's shared encoder-cache index: named Ray actors, sharded by mm_hash, owned by an
  EncoderCacheIndex-<model> deployment (cluster/cache_shards.py), so they end with the application. The ingress
  calls both pools over direct links (mmcore/link/pool_links.py), or through Serve's handles under
  ``ingress.transport: serve``.

``app_builder(args)`` is the import path for ``serve run`` / ``serve deploy`` configs:
``cluster.app:app_builder`` with the AppConfig as the application's ``args``.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable
from typing import TYPE_CHECKING, ClassVar

from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.autoscaling_policy import ENCODER_POLICY, LLM_POLICY
from cluster.budgets import encoder_budgets
from cluster.cache_shards import cache_index_args, cache_index_deployment, open_cache_index
from cluster.config import AppConfig, DeploymentOptions, ModelConfig
from cluster.model_dirs import resolve_model_dir
from cluster.replica_links import DirectLLM, DirectServed, pool_links
from cluster.tracing import setup_tracing

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from encoder_service.preprocess.make_preparer import PreprocessArgs
    from llm_service.request_spec import ReplicaTarget
    from router.http.auth import KeyRing

TP_LEADER_NUM_CPUS = 0.1  # the replica of a TP>1 encoder group only queues, batches and puts


def deployment_options(
    opts: DeploymentOptions, name: str, default_policy: str | None = None
) -> dict[str, object]:
    """Serve ``.options()`` for one pool; ``default_policy`` applies when the config names none."""
    out: dict[str, object] = {
        "name": name,
        "ray_actor_options": opts.ray_actor_options(),
        "max_ongoing_requests": opts.max_ongoing_requests,
        "max_queued_requests": opts.max_queued_requests,
        "graceful_shutdown_timeout_s": opts.graceful_shutdown_timeout_s,
        "logging_config": {"enable_access_log": opts.access_log},
    }
    if opts.num_replicas is not None:
        out["num_replicas"] = opts.num_replicas
    else:
        a = opts.autoscaling
        autoscaling: dict[str, object] = {
            "min_replicas": a.min_replicas,
            "max_replicas": a.max_replicas,
            "initial_replicas": a.initial_replicas,
            "target_ongoing_requests": a.target_ongoing_requests,
            "upscale_delay_s": a.upscale_delay_s,
            "downscale_delay_s": a.downscale_delay_s,
            "look_back_period_s": a.look_back_period_s,
        }
        if a.metrics_interval_s is not None:
            autoscaling["metrics_interval_s"] = a.metrics_interval_s
        if a.policy is not None:
            autoscaling["policy"] = a.policy.model_dump()
        elif default_policy is not None:
            autoscaling["policy"] = {"policy_function": default_policy}
        out["autoscaling_config"] = autoscaling
    return out


def encoder_placement(model: ModelConfig) -> dict[str, object]:
    """Where one encoder replica runs. TP size 1: the replica itself holds the rank's resources.

    TP size N > 1: one placement group per replica (Serve's ``placement_group_bundles``), so a
    replica is scheduled, autoscaled and torn down as one gang::

        bundle 0      the replica (leader: queue, batching, object-store puts)  CPU + node markers
        bundle 1..N   rank 0..N-1 (EncoderTPGroup actors)                        CPU, GPU + node markers

    Every bundle carries the pool's custom resources (``encoder_node``), so no rank lands elsewhere.
    GPU groups are STRICT_PACK (one node: NCCL over NVLink/PCIe); CPU groups PACK.
    """
    enc, d = model.encoder, model.encoder.deployment
    if enc.mm_encoder_tp_size == 1:
        return {}
    rank: dict[str, float] = {"CPU": d.num_cpus, **d.resources}
    if d.num_gpus:
        rank["GPU"] = d.num_gpus
    leader = {"CPU": TP_LEADER_NUM_CPUS, **d.resources}
    return {
        "ray_actor_options": {"num_cpus": TP_LEADER_NUM_CPUS, "resources": dict(d.resources)},
        "placement_group_bundles": [leader] + [dict(rank) for _ in range(enc.mm_encoder_tp_size)],
        "placement_group_strategy": "STRICT_PACK" if d.num_gpus else "PACK",
    }


def preprocess_args(m: ModelConfig) -> PreprocessArgs:
    """What preparing a model's requests takes from its config (an encoder replica, and the ingress's
    hit path)."""
    from encoder_service.preprocess.media.limits import MediaLimits

    return {
        "limits": MediaLimits(**m.preprocess.media.model_dump()),
        "limit_mm_per_prompt": dict(m.preprocess.limit_mm_per_prompt),
        "processor_cache_bytes": m.preprocess.processor_cache_bytes,
    }


def direct_pools(cfg: AppConfig, model: ModelConfig) -> tuple[str, ...]:
    """The model's pools the ingress calls over direct links (``ingress.transport: auto``), however
    many replicas they run: mmcore/link/pool_links.py routes each call as the pool's Serve router would."""
    if cfg.ingress.transport != "auto":
        return ()
    return ("llm", "preprocess")


def _encoder_pool(
    model: ModelConfig, cache_dir: str, cache_index: serve.Application, links: bool
) -> serve.Application:
    """The model's encoder pool; ``cache_index`` (its ``EncoderCacheIndex`` deployment) is bound here
    so that Serve deploys it with the app: the replicas find its shards by name."""
    from encoder_service.serve.preparing_encoder import PreparingEncoderServer
    from router.routing.request_routers import LeastQueuedEmbeddingsRouter

    class EncoderPool(PreparingEncoderServer, DirectServed):
        DIRECT_METHODS: ClassVar[dict[str, str]] = {"prepare": "prepare", "prepare_stream": "prepare_stream"}
        REF_STREAMS = frozenset({"prepare_stream"})  # its items hold the embeddings' refs
        LINKS_ON = links

        # Serve awaits either form; async here to start the link's listener on the first call.
        async def record_routing_stats(self) -> dict[str, object]:  # type: ignore[override]
            return {**super().record_routing_stats(), **await self.link_stats()}

        def stats(self) -> dict[str, object]:
            replica = str(serve.get_replica_context().replica_id.unique_id)
            return {**super().stats(), "link_calls": self.link_calls(), "replica_id": replica}

        # Serve's shutdown hook: refuse new frames, then drain the FIFO
        def __del__(self) -> Awaitable[int] | None:
            self.drain_link()
            return super().__del__()

        def __init__(
            self, model_json: dict[str, object], cache_dir: str, cache_index: DeploymentHandle
        ) -> None:
            setup_tracing("encoder")  # cluster/tracing.py: only if OTEL_* asks for it
            m = ModelConfig.model_validate(model_json)
            model_dir = resolve_model_dir(m, cache_dir)
            compute_budget, _ = encoder_budgets(m, model_dir)
            d = m.encoder.deployment
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
                cache=open_cache_index(*cache_index_args(m), links=links),
                max_queued_embeddings=m.encoder.max_queued_embeddings or 16 * compute_budget,
                step_embeds=m.encoder.encoder_step_embeds,
                torch_threads=m.encoder.torch_threads,
            )

    opts = deployment_options(model.encoder.deployment, f"EncoderPool-{model.name}", ENCODER_POLICY)
    opts.update(encoder_placement(model))
    opts["request_router_config"] = RequestRouterConfig(
        request_router_class=LeastQueuedEmbeddingsRouter, request_routing_stats_period_s=1.0
    )
    return serve.deployment(EncoderPool).options(**opts).bind(model.model_dump(), cache_dir, cache_index)


def _llm_server(model: ModelConfig, cache_dir: str, links: bool) -> serve.Application:
    from llm_service.serve.deployment import LLMServer
    from router.routing.request_routers import PrefixAffinityRouter

    class LLMPool(LLMServer, DirectLLM):
        LINKS_ON = links

        # Serve awaits either form; async here to start the link's listener on the first call.
        async def record_routing_stats(self) -> dict[str, object]:  # type: ignore[override]
            return {**super().record_routing_stats(), **await self.link_stats()}

        def stats(self, target: ReplicaTarget | None = None) -> dict[str, object]:
            return {
                **super().stats(target),
                "link_calls": self.link_calls(),
                "link_channel_batches": self.linked_channel_batches,
            }

        def __init__(self, model_json: dict[str, object], cache_dir: str) -> None:
            from llm_service.config import EngineConfig

            setup_tracing("llm")
            m = ModelConfig.model_validate(model_json)
            llm = m.llm
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
            )

    opts = deployment_options(model.llm.deployment, f"LLMServer-{model.name}", LLM_POLICY)
    opts["request_router_config"] = RequestRouterConfig(
        request_router_class=PrefixAffinityRouter, request_routing_stats_period_s=1.0
    )
    return serve.deployment(LLMPool).options(**opts).bind(model.model_dump(), cache_dir)


def model_modalities(model_dir: str) -> list[str]:
    """What the model's family takes (image, video, audio), from the family registry."""
    import json
    from pathlib import Path

    from encoder_service.families import encoder_family

    model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    return list(encoder_family(model_type, model_dir).modalities)


def _ingress(config: AppConfig, pools: dict[str, dict[str, serve.Application]]) -> serve.Application:
    from router.http.app import HTTPOptions, IngressModel, IngressServer
    from router.protocol.messages import MessageLimits
    from router.routing.admission import AdmissionLimits

    class Ingress(IngressServer):
        # @serve.ingress made the parent's __init__ async: a subclass must await it.
        async def __init__(  # type: ignore[misc]
            self, config_json: dict[str, object], pools: dict[str, dict[str, DeploymentHandle]]
        ) -> None:
            setup_tracing("ingress")
            cfg = AppConfig.model_validate(config_json)
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
                    IngressModel(
                        m.name,
                        model_dir,
                        m.llm.block_size,
                        m.llm.max_model_len,
                        limits,
                        model_modalities(model_dir),
                        open_cache_index(*cache_index_args(m), links=cfg.ingress.transport == "auto"),
                        preprocess_args(m),
                        m.preprocess.hit_path_cache_entries,
                        m.preprocess.hit_path_cache_ttl_s,
                        direct=direct_pools(cfg, m),
                        # each link call's deadline: the request's own, not the link's 300 s default
                        link_to=functools.partial(pool_links, timeout_s=cfg.ingress.request_timeout_s),
                        overlap_prefill=m.preprocess.overlap_prefill,
                    )
                )
            ing = cfg.ingress
            http = HTTPOptions(
                ing.http_mode,
                cfg.host,
                cfg.port,
                ing.max_request_bytes,
                ing.deployment.graceful_shutdown_timeout_s,
                max_json_values=ing.max_json_values,
                request_timeout_s=ing.request_timeout_s,
            )
            a = ing.admission
            admission = AdmissionLimits(
                a.max_concurrent_requests,
                a.max_concurrent_cost,
                dict(a.media_cost),
                a.text_chars_per_cost,
                a.retry_after_s,
            )
            await super().__init__(models, pools, http, admission, keys=ingress_keys(cfg))  # type: ignore[misc]

    opts = deployment_options(config.ingress.deployment, "Ingress")
    return serve.deployment(Ingress).options(**opts).bind(config.model_dump(), pools)


def ingress_keys(cfg: AppConfig) -> KeyRing:
    """The ingress replica's ``KeyRing``: ``ingress.api_key`` (or ``MMSERVE_API_KEY`` where the replica
    runs) and ``ingress.api_keys_file`` (read here, on the replica's node: e.g. a mounted Secret)."""
    import os

    from router.http.auth import API_KEY_ENV, KeyRing

    ing = cfg.ingress
    api_key = ing.api_key.get_secret_value() if ing.api_key is not None else os.environ.get(API_KEY_ENV)
    return KeyRing.from_sources(api_key or None, ing.api_keys_file)


def build_app(config: AppConfig) -> serve.Application:
    pools = {}
    links = config.ingress.transport == "auto"  # cache-shard links too: `serve` opens no side channel
    for m in config.models:
        llm = _llm_server(m, config.models_cache_dir, links)
        index = cache_index_deployment(config, m)
        # the encoder replicas answer `prepare` themselves (encoder_service/serve/preparing_encoder.py)
        encoder = _encoder_pool(m, config.models_cache_dir, index, links)
        pools[m.name] = {"preprocess": encoder, "encoder": encoder, "llm": llm}
    return _ingress(config, pools)


def app_builder(args: dict[str, object]) -> serve.Application:
    """Serve config entry point: ``import_path: cluster.app:app_builder``, ``args`` = AppConfig."""
    return build_app(AppConfig.model_validate(args))
