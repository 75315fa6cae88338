"""Host-name lookups run on their own bounded pool with a timeout: a zone whose name server never
answers neither stalls the decoding of other items nor holds a fetch past ``dns_timeout_s``.

The resolver here is injected and blocks until the test lets it go, then fails: no real name is ever
resolved and nothing is connected to.
"""

from __future__ import annotations

import asyncio
import base64
import os
import threading

import pytest

from encoder_service.preprocess.errors import MediaFetchError
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.media.fetch import fetch_http
from encoder_service.preprocess.media.loader import load_media
from encoder_service.types import MediaRef
from tests.media import make_image_bytes

# asyncio's default executor (what asyncio.to_thread runs on): ThreadPoolExecutor's default size
DEFAULT_EXECUTOR_THREADS = min(32, (os.cpu_count() or 1) + 4)


class HangingResolver:
    """A name server that never answers: each lookup blocks until ``let_go``, then fails."""

    def __init__(self) -> None:
        self._go = threading.Event()
        self._lock = threading.Lock()
        self.calls = 0

    def __call__(self, host: str, port: int) -> list[str]:
        with self._lock:
            self.calls += 1
        self._go.wait(60)
        raise OSError(f"{host}: no answer")

    def let_go(self) -> None:
        self._go.set()


@pytest.fixture
def hanging():
    resolver = HangingResolver()
    yield resolver
    resolver.let_go()  # frees the lookup threads for the next test


def test_a_data_url_decodes_while_more_lookups_hang_than_the_default_executor_has_threads(hanging):
    png = base64.b64encode(make_image_bytes(32, 24)).decode()
    ref = MediaRef("image", url=f"data:image/png;base64,{png}")
    limits = MediaLimits(fetch_timeout_s=120.0)

    async def scenario() -> tuple[int, int]:
        fetches = [
            asyncio.create_task(fetch_http(f"http://hang{i}.test/a.png", limits, item=i, resolver=hanging))
            for i in range(DEFAULT_EXECUTOR_THREADS + 2)
        ]
        await asyncio.sleep(0.2)  # let the lookups take their threads
        try:
            async with asyncio.timeout(15):  # a guard against a hang, not a timing: decoding is ms
                loaded = await load_media(ref, limits, item=0)
        finally:
            for f in fetches:
                f.cancel()
            hanging.let_go()
            await asyncio.gather(*fetches, return_exceptions=True)
        return loaded.value.size

    assert asyncio.run(scenario()) == (32, 24)


def test_a_lookup_past_dns_timeout_s_fails_its_item_with_a_fetch_error(hanging):
    limits = MediaLimits(fetch_timeout_s=60.0, dns_timeout_s=0.2)
    with pytest.raises(
        MediaFetchError, match=r"^image 3: looking up the host of http://hang\.test/a\.png"
    ) as e:
        asyncio.run(fetch_http("http://hang.test/a.png", limits, item=3, label="image 3", resolver=hanging))
    assert e.value.item == 3 and e.value.status_code == 400
    assert "dns_timeout_s=0.2" in str(e.value)


def test_lookups_hold_at_most_the_pools_threads_and_queued_ones_never_run(hanging):
    from encoder_service.preprocess.media.dns_pool import DNS_THREADS

    limits = MediaLimits(fetch_timeout_s=60.0, dns_timeout_s=1.0)

    async def scenario() -> list[BaseException | bytes]:
        return await asyncio.gather(
            *(
                fetch_http(f"http://hang{i}.test/", limits, item=i, resolver=hanging)
                for i in range(DNS_THREADS + 3)
            ),
            return_exceptions=True,
        )

    results = asyncio.run(scenario())
    assert all(isinstance(r, MediaFetchError) and r.item == i for i, r in enumerate(results))
    assert hanging.calls == DNS_THREADS  # the 3 queued behind them timed out and were dropped unrun
