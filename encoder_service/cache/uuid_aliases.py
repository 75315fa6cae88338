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


class AliasStore(Protocol):
    """What the preprocessor needs of the names (``Preprocessor(aliases=...)``)."""

    async def resolve(self, keys: list[str]) -> dict[str, str]: ...

    async def point(self, aliases: Mapping[str, str]) -> None: ...


class UuidAliases:
    """alias key → mm_hash, least recently used first; ``max_entries`` bounds it."""

    def __init__(self, max_entries: int = MAX_ALIASES) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be positive")
        self.max_entries = max_entries
        self._to_hash: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._to_hash)

    def point(self, aliases: Mapping[str, str]) -> None:
        for key, mm_hash in aliases.items():
            self._to_hash[key] = mm_hash
            self._to_hash.move_to_end(key)
        while len(self._to_hash) > self.max_entries:
            self._to_hash.popitem(last=False)

    def resolve(self, keys: list[str]) -> dict[str, str]:
        out = {}
        for key in keys:
            mm_hash = self._to_hash.get(key)
            if mm_hash is not None:
                self._to_hash.move_to_end(key)
                out[key] = mm_hash
        return out


class LocalAliases:
    """``AliasStore`` over in-process books."""

    def __init__(self, books: UuidAliases | None = None) -> None:
        self.books = books or UuidAliases()

    async def resolve(self, keys: list[str]) -> dict[str, str]:
        return self.books.resolve(keys)

    async def point(self, aliases: Mapping[str, str]) -> None:
        self.books.point(aliases)
