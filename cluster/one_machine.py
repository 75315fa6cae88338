"""What ``mmserve serve`` writes into a config's dump for one machine: its defaults (direct HTTP, one
encoder-cache shard, fixed replica counts where autoscaling cannot move), ``--cpu-affinity``'s pins and
their check against the machine's cores, ``--pd``'s prefill and decode pools."""

from __future__ import annotations

from collections.abc import Mapping

from cluster.config import AppConfig

CPU_AFFINITY_POOLS = ("ingress", "encoder", "llm", "prefill", "decode")


def pin_pool(data: dict[str, object], flag: str) -> None:
    """``--cpu-affinity POOL=CORES``: that pool's ``deployment.cpu_affinity`` in ``data`` (a config's
    dump), for every model; the cores' form is checked with the config."""
    pool, sep, cores = flag.partition("=")
    if not sep or pool not in CPU_AFFINITY_POOLS:
        raise SystemExit(
            f"--cpu-affinity {flag!r}: POOL=CORES with POOL one of {', '.join(CPU_AFFINITY_POOLS)}"
        )
    if pool == "ingress":
        _field(_field(data, "ingress"), "deployment")["cpu_affinity"] = cores
        return
    for m in data["models"]:  # type: ignore[attr-defined]
        if pool in ("encoder", "llm"):
            _field(_field(m, pool), "deployment")["cpu_affinity"] = cores
            continue
        roles = [p for p in _field(m, "llm")["pools"] if p["role"] == pool]  # type: ignore[attr-defined]
        if not roles:
            raise SystemExit(f"--cpu-affinity {flag!r}: model {m['name']!r} has no {pool} pool (--pd)")
        roles[0]["deployment"]["cpu_affinity"] = cores


def pd_pools(deployment: Mapping[str, object]) -> list[dict[str, object]]:
    """``--pd``: a prefill and a decode pool, each with the model's LLM deployment options."""
    import copy

    return [{"role": role, "deployment": copy.deepcopy(dict(deployment))} for role in ("prefill", "decode")]


def _field(dump: Mapping[str, object], key: str) -> dict[str, object]:
    """``dump[key]``, a nested model of a config's ``model_dump()``."""
    value = dump[key]
    assert isinstance(value, dict), f"{key}: a model's dump, not {value!r}"
    return value


def one_machine_defaults(cfg: AppConfig, data: dict[str, object]) -> None:
    """What one machine runs unless ``cfg`` says otherwise, written into ``data`` (``cfg``'s dump):
    the ingress serves HTTP itself (no proxy hop), each model's encoder cache is one shard (one
    process fewer), and a pool whose autoscaling bounds leave it one count runs that many replicas
    fixed."""
    ingress = _field(data, "ingress")
    if "http_mode" not in cfg.ingress.model_fields_set:
        ingress["http_mode"] = "direct"
    fixed_replica_counts(_field(ingress, "deployment"))
    models = data["models"]
    assert isinstance(models, list)
    for m, model in zip(models, cfg.models, strict=True):
        if "cache_index_shards" not in model.encoder.model_fields_set:
            _field(m, "encoder")["cache_index_shards"] = 1
        for pool in ("encoder", "llm"):
            fixed_replica_counts(_field(_field(m, pool), "deployment"))
        for llm_pool in _field(m, "llm")["pools"]:  # type: ignore[attr-defined]
            fixed_replica_counts(_field(llm_pool, "deployment"))


def check_cpu_affinity(cfg: AppConfig, node_cores: set[int]) -> None:
    """One machine: every pool's ``cpu_affinity`` names cores of this machine (a ``CpuAffinityError``
    naming the pool's deployment); each replica checks again where it starts."""
    from cluster.cpu_affinity import check_cores, parse_cpu_affinity

    for name, opts in cfg.pool_deployments().items():
        if opts.cpu_affinity is not None:
            check_cores(parse_cpu_affinity(opts.cpu_affinity), node_cores, name)


def fixed_replica_counts(deployment: dict[str, object]) -> None:
    """``num_replicas: n`` for a pool autoscaled within ``[n, n]`` (``DeploymentOptions``' dump).

    Nothing can scale there, but with an ``autoscaling_config`` every handle and replica still pushes
    its load to the Serve controller, which runs the policy on it. Measured at image c=32 (README,
    "What one machine runs"): the idle background fell, the controller's ~2 CPU-ms per request did
    not consistently (most of it is something else)."""
    a = _field(deployment, "autoscaling")
    lo, hi = a["min_replicas"], a["max_replicas"]
    if deployment["num_replicas"] is None and isinstance(lo, int) and lo == hi and lo >= 1:
        deployment["num_replicas"] = lo
