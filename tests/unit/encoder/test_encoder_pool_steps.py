"""EncoderPoolServer's steps (no Ray: no cache): a request handed on item by item (``submit_apart``,
what ``prepare_stream`` uses) gets one step per item, a plain one shares its step; the tower runs
on the replica's own step thread, not on the loop's default executor."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from cluster.bench.encoder import make_inputs
from encoder_service.serve.deployment import EncoderPoolServer
from encoder_service.types import EncodeBatch


def test_apart_items_take_a_step_each_and_plain_ones_share(tiny_vl_dir: Path) -> None:
    server = EncoderPoolServer(str(tiny_vl_dir), device="cpu")
    steps: list[tuple[list[str], str]] = []
    encode = server._encode

    async def recording(items):  # type: ignore[no-untyped-def]
        out = await encode(items)
        steps.append(([it.mm_hash for it in items], recorded_thread[0]))
        return out

    recorded_thread = [""]
    runner = server._runner
    assert runner is not None
    real = runner.encode

    def on_thread(items):  # type: ignore[no-untyped-def]
        recorded_thread[0] = threading.current_thread().name
        return real(items)

    runner.encode = on_thread  # type: ignore[method-assign]
    server._encode = recording  # type: ignore[method-assign]
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
