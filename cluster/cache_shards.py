"""A model's encoder-cache index shards, in the Serve application's lifecycle::

    EncoderCacheIndex-<model>   Serve deployment, one replica, no CPU: creates the shards and owns them
      └─ mmserve-encoder-cache-<model>-0..N-1   CacheIndexShard actors: named, not detached

Ray ends an actor with its owner, and Serve ends the owner with the application, so ``serve delete``
and ``serve shutdown`` leave no shard behind (they were detached actors that outlived every app).
Every ingress, preprocessor and encoder replica, on any node, finds the shards by name
(``open_cache_index``) and never creates one: a client replica's restart or scale-down leaves them
alone. What the owner's life costs the cache:

  owner crashes        its shards end with it; Serve starts a new owner, which creates them again
                       (empty: their entries are misses), and the clients find them by name
  owner redeployed     the same (only when its own code or sizing changes)
  shard killed         Ray restarts a crashed one (``max_restarts``); one gone for good is created
                       again by the owner's health check (Serve's, every ``HEALTH_CHECK_S``)
  app deleted          the owner waits until the app's other replicas are gone (an encoder's shutdown
                       still drops the entries it owns), then ends its shards

``links``: with ``ingress.transport: auto`` each client reaches its shards' hot methods over a direct
link (cluster/replica_links.py); with ``serve`` it makes actor calls only and no shard ever listens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable
from typing import ClassVar

import ray
from ray import serve

from cluster.budgets import encoder_budgets, largest_item_embeds, row_units
from cluster.config import AppConfig, ModelConfig
from cluster.replica_links import DirectServed, direct_link
from encoder_service.cache.cache_client import LINK_METHODS, EncoderCacheClient, ShardSpec, shard_capacity
from encoder_service.cache.cache_index import CacheIndexShard as ShardBooks

logger = logging.getLogger("mmserve.encoder")

NAMESPACE = "mmserve"
OWNER_PREFIX = "EncoderCacheIndex-"
HEALTH_CHECK_S = 2.0  # how soon the owner creates a shard again that is gone for good
POLL_S = 0.2


class CacheIndexShard(ShardBooks, DirectServed):
    """``cache_index.CacheIndexShard`` as its actor (Ray names the process after this class), with a
    direct link for ``LINK_METHODS`` (cluster/replica_links.py), opened by the first client that asks
    where it listens: with ``transport: serve`` none ever does."""

    DIRECT_METHODS: ClassVar[dict[str, str]] = {name: name for name in LINK_METHODS}


def cache_index_args(m: ModelConfig) -> tuple[str, int, int, int]:
    """(name prefix, shards, capacity in embeddings, largest admitted item) of a model's shared
    encoder cache: the one place it is sized. Each shard holds at least the largest item."""
    _, cache_size = encoder_budgets(m)
    return (
        f"mmserve-encoder-cache-{m.name}",
        m.encoder.cache_index_shards,
        cache_size,
        largest_item_embeds(m) * row_units(m),
    )


def owned_shard_spec(
    name_prefix: str,
    num_shards: int,
    capacity: int,
    largest_item: int = 0,
    uuid_names_per_tenant: int | None = None,
) -> ShardSpec:
    """The shards as the owner creates them and the clients find them (the same spec on both sides).
    A tenant's uuid names spread over the shards by key hash: each shard keeps its share of the quota."""
    per_shard = shard_capacity(num_shards, capacity, largest_item)
    names = None if uuid_names_per_tenant is None else -(-uuid_names_per_tenant // num_shards)
    return ShardSpec(
        name_prefix,
        per_shard,
        namespace=NAMESPACE,
        actor_class=CacheIndexShard,
        created_by_clients=False,
        uuid_names_per_tenant=names,
    )


def open_cache_index(
    name_prefix: str,
    num_shards: int,
    capacity: int,
    largest_item: int = 0,
    *,
    links: bool = False,
    uuid_names_per_tenant: int | None = None,
) -> EncoderCacheClient:
    """A client of the model's shards (``cache_index_args``), which its owner creates: each is found
    by name on first use. ``links``: the hot methods over direct links (``ingress.transport: auto``)."""
    spec = owned_shard_spec(name_prefix, num_shards, capacity, largest_item, uuid_names_per_tenant)
    return EncoderCacheClient([None] * num_shards, spec, link_to=direct_link if links else None)


class EncoderCacheIndex:
    """The owner of one model's shards: a Serve replica that creates them, keeps them there, and
    ends them when the application is deleted (module docstring)."""

    def __init__(self, spec: ShardSpec, num_shards: int) -> None:
        self.spec = spec
        self.shards = [spec.create(i) for i in range(num_shards)]  # get_if_exists: see check_health

    def check_health(self) -> None:
        """Serve's periodic call: create again a shard that is gone for good (killed, or a former
        owner's, which this replica found by name when it started and which ended with that owner).
        Never raises: an unhealthy owner would be replaced, and its shards would end with it."""
        for i in range(len(self.shards)):
            try:
                self._ensure(i)
            except Exception:  # e.g. the GCS did not answer: again at the next check
                logger.exception("encoder-cache shard %s: could not check it", self.spec.name(i))

    def _ensure(self, index: int) -> None:
        try:
            ray.get_actor(self.spec.name(index), namespace=self.spec.namespace)
        except ValueError:
            logger.warning("encoder-cache shard %s was gone: created again (empty)", self.spec.name(index))
            self.shards[index] = self.spec.create(index)

    def __del__(self) -> Awaitable[None] | None:
        """Serve's shutdown hook (it awaits the coroutine); a plain ``def``, as the garbage collector
        calls it too, outside any loop, where it does nothing."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return None
        return self._end_shards()

    async def _end_shards(self) -> None:
        ctx = serve.get_replica_context()
        try:
            while await asyncio.to_thread(_others_of_app_deleting, ctx.app_name):
                await asyncio.sleep(POLL_S)  # Serve's graceful_shutdown_timeout_s bounds the wait
        except Exception:  # the shards end with this replica all the same
            logger.exception("encoder-cache index: could not wait for the app's other replicas")
        for shard in self.shards:
            ray.kill(shard)


def _others_of_app_deleting(app_name: str) -> int:
    """While ``app_name`` is being deleted, how many of its replicas other than the cache owners' are
    still alive (running or stopping); 0 otherwise. Counted from Serve's replica actors, named
    ``SERVE_REPLICA::<app>#<deployment>#<id>``: a deleting app's status lists no deployments."""
    app = serve.status().applications.get(app_name)
    if app is None or app.status != "DELETING":
        return 0
    prefix, owners = f"SERVE_REPLICA::{app_name}#", f"SERVE_REPLICA::{app_name}#{OWNER_PREFIX}"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return sum(1 for n in names if n.startswith(prefix) and not n.startswith(owners))


def cache_index_deployment(config: AppConfig, m: ModelConfig) -> serve.Application:
    """The model's ``EncoderCacheIndex`` deployment, bound: pass it to a deployment of the app (Serve
    deploys what the ingress reaches). It stays through the others' graceful shutdowns."""
    pools = [m.encoder.deployment, m.llm.deployment, config.ingress.deployment]
    outlive_s = max(d.graceful_shutdown_timeout_s for d in pools) + 10.0
    opts: dict[str, object] = {
        "name": f"{OWNER_PREFIX}{m.name}",
        "num_replicas": 1,
        "ray_actor_options": {"num_cpus": 0},
        "health_check_period_s": HEALTH_CHECK_S,
        "graceful_shutdown_timeout_s": outlive_s,
        "logging_config": {"enable_access_log": False},
    }
    prefix, num_shards, capacity, largest = cache_index_args(m)
    spec = owned_shard_spec(prefix, num_shards, capacity, largest, m.encoder.uuid_names_per_tenant)
    spec = dataclasses.replace(spec, resources=tuple(sorted(m.encoder.cache_index_resources.items())))
    return serve.deployment(EncoderCacheIndex).options(**opts).bind(spec, num_shards)
