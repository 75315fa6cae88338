"""Client-chosen media ``uuid`` names: ``uuid_alias_key(model, modality, tenant, uuid)`` → mm_hash.

The rule (README, "Security model"): an mm_hash always names content. A part that carries bytes is
keyed by its bytes; if it also carries a uuid, the name is (re-)pointed at those bytes' mm_hash in the
sender's namespace only. A part with a uuid alone resolves the name in the sender's namespace; an
unknown name, or one whose content the encoder cache no longer holds, is a 400 ``mm_cache_miss``.
So different bytes under a uuid already in use change only what that tenant's later uuid-only parts
get, never what a part with bytes gets, and never anything another tenant sees.

``UuidAliases`` keeps the books (a bounded LRU, pure Python); ``LocalAliases`` serves them in-process
(one preprocessor, tests). Served, they live in the model's encoder-cache shards next to the entries
they name (``cache_index``: each shard keeps the names whose key hashes to it, and the cache client is
the preprocessor's ``AliasStore``), so they cost no process of their own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Protocol

MAX_ALIASES = 262_144  # names remembered per model (LRU); ~100 bytes each
MAX_ALIASES_PER_TENANT = 65_536  # of those, at most this many per tenant (encoder.uuid_names_per_tenant)


class AliasStore(Protocol):
    """What the preprocessor needs of the names (``Preprocessor(aliases=...)``). ``tenant`` is whose
    names ``point`` adds (None: the server has no API keys): each tenant has its own quota."""

    async def resolve(self, keys: list[str]) -> dict[str, str]: ...

    async def point(self, aliases: Mapping[str, str], tenant: str | None = None) -> None: ...


class UuidAliases:
    """alias key → mm_hash, least recently used first, evicted fairly between tenants.

    Each tenant's names are an LRU of their own, at most ``max_per_tenant`` long: a tenant past its
    quota drops its own oldest name. Past ``max_entries`` in all, the tenant holding the most names
    drops its oldest. So one tenant sending fresh uuids in a loop flushes only its own names, never
    another's that stays within its share::

        tenant A: [a1 a2 a3]              <- point(A, a4) past A's quota drops a1, never b1
        tenant B: [b1 b2]
    """

    def __init__(self, max_entries: int = MAX_ALIASES, max_per_tenant: int | None = None) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be positive")
        if max_per_tenant is not None and max_per_tenant < 1:
            raise ValueError("max_per_tenant must be positive")
        self.max_entries = max_entries
        self.max_per_tenant = min(max_entries, max_per_tenant or max_entries)
        self._by_tenant: dict[str | None, OrderedDict[str, str]] = {}
        self._tenant_of: dict[str, str | None] = {}  # alias key -> whose it is

    def __len__(self) -> int:
        return len(self._tenant_of)

    def names_of(self, tenant: str | None) -> int:
        return len(self._by_tenant.get(tenant, ()))

    def point(self, aliases: Mapping[str, str], tenant: str | None = None) -> None:
        own = self._by_tenant.setdefault(tenant, OrderedDict())
        for key, mm_hash in aliases.items():
            previous = self._tenant_of.get(key, tenant)
            if previous != tenant:  # keys embed the tenant: only a hash collision gets here
                self._drop(key)
            own[key] = mm_hash
            own.move_to_end(key)
            self._tenant_of[key] = tenant
        while len(own) > self.max_per_tenant:
            self._tenant_of.pop(own.popitem(last=False)[0])
        while len(self._tenant_of) > self.max_entries:
            largest = max(self._by_tenant.values(), key=len)
            self._tenant_of.pop(largest.popitem(last=False)[0])
        if not own:
            del self._by_tenant[tenant]

    def _drop(self, key: str) -> None:
        tenant = self._tenant_of.pop(key)
        names = self._by_tenant[tenant]
        del names[key]
        if not names:
            del self._by_tenant[tenant]

    def resolve(self, keys: list[str]) -> dict[str, str]:
        out = {}
        for key in keys:
            if key not in self._tenant_of:
                continue
            names = self._by_tenant[self._tenant_of[key]]
            names.move_to_end(key)
            out[key] = names[key]
        return out


class LocalAliases:
    """``AliasStore`` over in-process books."""

    def __init__(self, books: UuidAliases | None = None) -> None:
        self.books = books if books is not None else UuidAliases()  # an empty one is falsy

    async def resolve(self, keys: list[str]) -> dict[str, str]:
        return self.books.resolve(keys)

    async def point(self, aliases: Mapping[str, str], tenant: str | None = None) -> None:
        self.books.point(aliases, tenant)
