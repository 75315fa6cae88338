"""Host-name lookups on their own bounded thread pool, each bounded by ``MediaLimits.dns_timeout_s``.

``getaddrinfo`` holds its thread until the name server answers or the system resolver gives up (tens
of seconds for a zone whose server never answers). On the default executor, which ``asyncio.to_thread``
shares with media decoding (``loader.py``, ``processing.py``), a burst of such URLs would take every
thread and stall the decoding of other tenants' ``data:`` images. Here::

    fetch hop ──submit──▶ media-dns pool (DNS_THREADS threads) ──▶ resolve_checked(url)
        │                     a lookup past dns_timeout_s (queueing included) fails its item with
        └─ decoding ──▶ default executor, never shared with a lookup

A lookup that times out while still queued is dropped without running; one already running keeps its
thread until the resolver returns, so a hung zone holds at most ``DNS_THREADS`` threads.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from concurrent.futures import ThreadPoolExecutor

from encoder_service.preprocess.errors import MediaFetchError
from encoder_service.preprocess.media.limits import MediaLimits
from encoder_service.preprocess.media.url_safety import CheckedHost, Resolver, resolve_checked

DNS_THREADS = 8

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def dns_executor() -> ThreadPoolExecutor:
    """The process's lookup pool, made on first use (every event loop of the process shares it)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=DNS_THREADS, thread_name_prefix="media-dns")
        return _pool


async def resolve_checked_async(
    url: str, limits: MediaLimits, *, resolver: Resolver, item: int | None, label: str
) -> CheckedHost:
    """``resolve_checked`` for one redirect hop, on the lookup pool, within ``limits.dns_timeout_s``."""
    job = functools.partial(
        resolve_checked,
        url,
        allowed_domains=limits.allowed_domains,
        allow_private_addresses=limits.allow_private_addresses,
        resolver=resolver,
        item=item,
        label=label,
    )
    # cancelling the wrapper (the timeout) cancels the pool's future: a queued lookup never runs
    lookup = asyncio.wrap_future(dns_executor().submit(job))
    try:
        async with asyncio.timeout(limits.dns_timeout_s):
            return await lookup
    except TimeoutError:
        raise MediaFetchError(
            f"{label}: looking up the host of {url} took longer than dns_timeout_s={limits.dns_timeout_s}",
            item=item,
        ) from None
