"""EncoderServer's steps (no Ray: no cache): a request handed on item by item (``submit_apart``,
what ``prepare_stream`` uses) gets one step per item, a plain one shares its step; the tower runs
on the replica's own step thread, not on the loop's default executor, and its clock counts them."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from cluster.bench.encoder import make_inputs
from encoder_service.serve.deployment import EncoderServer
from encoder_service.types import EncodeBatch, EncoderInput
from tests.integration.local_app import own_ray


@pytest.fixture(autouse=True, scope="module")
def _ray():  # type: ignore[no-untyped-def]
    """A step puts its outputs with ``ray.put``: on the session's Ray (``own_ray``), not on a local
    Ray that ``ray.put`` would start here and the next module's could not start beside."""
    with own_ray():
        yield


def test_apart_items_take_a_step_each_and_plain_ones_share(tiny_vl_dir: Path) -> None:
    server = EncoderServer(str(tiny_vl_dir), device="cpu")
    runner = server._steps.runner
    assert runner is not None
    encode = runner.encode
    steps: list[tuple[list[str], str]] = []  # each tower call: its items, the thread it ran on

    def recorded(items: list[EncoderInput]):  # type: ignore[no-untyped-def]
        steps.append(([it.mm_hash for it in items], threading.current_thread().name))
        return encode(items)

    runner.encode = recorded  # type: ignore[method-assign]
    streamed, plain = make_inputs(tiny_vl_dir, 3, 56), make_inputs(tiny_vl_dir, 2, 56)
    for i, it in enumerate(streamed):
        it.mm_hash = f"s{i}"
    for i, it in enumerate(plain):
        it.mm_hash = f"p{i}"

    async def main() -> None:
        futures = server.submit_apart(EncodeBatch("streamed", streamed))
        futures += server.submit(EncodeBatch("plain", plain))
        await asyncio.gather(*futures)

    asyncio.run(main())
    assert [hashes for hashes, _ in steps] == [["s0"], ["s1"], ["s2", "p0", "p1"]]
    assert all(name.startswith("encoder-step") for _, name in steps)
    clock = server._steps.step_clock  # the step thread's clock counted the three steps
    assert server.stats()["steps"] == 3
    assert 0 < clock.cpu_s <= clock.wall_s
