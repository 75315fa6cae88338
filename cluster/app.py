"""``build_app(config)``: the Ray Serve application — ingress plus, per model, two pools.

  IngressServer ─┬─▶ EncoderServer-<model>  (GPU; prepares its requests; router: fewest queued embeddings)
                 └─▶ LLMServer-<model>      (GPU; router: prefix-cache affinity; tokens back on output channels)
  or, E/P/D (``llm.pools``), in place of LLMServer-<model>:
                 ├─▶ LLMPrefillServer-<model> (prompt + first token; router: prefix-cache affinity)
                 └─▶ LLMDecodeServer-<model>  (pulls the KV from the prefill replica; router: free KV, load)
  plus the model's shared encoder-cache index: named Ray actors, sharded by mm_hash, owned by an
  EncoderCacheIndex-<model> deployment (cluster/cache_shards.py), so they end with the application. The ingress
  calls both pools over direct links (mmcore/link/pool_links.py), or through Serve's handles under
  ``ingress.transport: serve``.

The replica classes are cluster/replicas.py's, named as their deployments; this module only turns the
config into their Serve options and binds them. ``app_builder(args)`` is the import path for
``serve run`` / ``serve deploy`` configs: ``cluster.app:app_builder`` with the AppConfig as ``args``.
"""

from __future__ import annotations

from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.autoscaling_policy import ENCODER_POLICY, LLM_POLICY, PREFILL_POLICY
from cluster.cache_shards import cache_index_deployment
from cluster.config import AppConfig, DeploymentOptions, ModelConfig
from cluster.malloc_env import ENCODER_MALLOC_ENV

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


def with_env_vars(actor_options: object, env: dict[str, str]) -> dict[str, object]:
    """``ray_actor_options`` with ``env`` in its runtime_env's env_vars (one already set there wins). Serve
    merges an app's runtime_env env_vars with these, these winning for the names both set."""
    opts = dict(actor_options)  # type: ignore[call-overload]
    runtime_env = dict(opts.get("runtime_env") or {})
    runtime_env["env_vars"] = {**env, **(runtime_env.get("env_vars") or {})}
    opts["runtime_env"] = runtime_env
    return opts


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


def encoder_server(
    model: ModelConfig, cache_dir: str, cache_index: serve.Application, links: bool
) -> serve.Application:
    """The model's encoder pool; ``cache_index`` (its ``EncoderCacheIndex`` deployment) is bound here
    so that Serve deploys it with the app: the replicas find its shards by name."""
    from cluster.replicas import EncoderServer
    from router.routing.request_routers import LeastQueuedEmbeddingsRouter

    opts = deployment_options(model.encoder.deployment, f"EncoderServer-{model.name}", ENCODER_POLICY)
    opts.update(encoder_placement(model))
    opts["ray_actor_options"] = with_env_vars(opts["ray_actor_options"], ENCODER_MALLOC_ENV)
    opts["request_router_config"] = RequestRouterConfig(
        request_router_class=LeastQueuedEmbeddingsRouter, request_routing_stats_period_s=1.0
    )
    app: serve.Application = (
        serve.deployment(EncoderServer)
        .options(**opts)
        .bind(model.model_dump(), cache_dir, cache_index, links)
    )
    return app


def llm_server(model: ModelConfig, cache_dir: str, links: bool, role: str = "both") -> serve.Application:
    """The model's LLM pool of ``role``: ``both`` (``LLMServer-<model>``), or E/P/D's ``prefill``
    (``LLMPrefillServer-<model>``, routed by prefix affinity) and ``decode`` (``LLMDecodeServer-<model>``,
    routed by free KV and load), each on its own ``llm.pools`` entry's options."""
    from cluster.replicas import LLMDecodeServer, LLMPrefillServer, LLMServer
    from router.routing.request_routers import FreeKVRouter, PrefixAffinityRouter

    cls = {"both": LLMServer, "prefill": LLMPrefillServer, "decode": LLMDecodeServer}[role]
    policy = PREFILL_POLICY if role == "prefill" else LLM_POLICY
    opts = deployment_options(model.llm.pool(role), f"{cls.__name__}-{model.name}", policy)
    opts["request_router_config"] = RequestRouterConfig(
        request_router_class=FreeKVRouter if role == "decode" else PrefixAffinityRouter,
        request_routing_stats_period_s=1.0,
    )
    app: serve.Application = serve.deployment(cls).options(**opts).bind(model.model_dump(), cache_dir, links)
    return app


def ingress_server(config: AppConfig, pools: dict[str, dict[str, serve.Application]]) -> serve.Application:
    from cluster.replicas import IngressServer

    opts = deployment_options(config.ingress.deployment, "IngressServer")
    app: serve.Application = serve.deployment(IngressServer).options(**opts).bind(config.model_dump(), pools)
    return app


def build_app(config: AppConfig) -> serve.Application:
    pools = {}
    links = config.ingress.transport == "auto"  # cache-shard links too: `serve` opens no side channel
    for m in config.models:
        # one pool `llm` (role both), or E/P/D's `prefill` and `decode` (router/journey/pd_client.py)
        llms = {
            "llm" if role == "both" else role: llm_server(m, config.models_cache_dir, links, role)
            for role in m.llm.roles
        }
        index = cache_index_deployment(config, m)
        # the encoder replicas answer `prepare` themselves (encoder_service/serve/deployment.py)
        encoder = encoder_server(m, config.models_cache_dir, index, links)
        pools[m.name] = {"encoder": encoder, **llms}
    return ingress_server(config, pools)


def app_builder(args: dict[str, object]) -> serve.Application:
    """Serve config entry point: ``import_path: cluster.app:app_builder``, ``args`` = AppConfig."""
    return build_app(AppConfig.model_validate(args))
