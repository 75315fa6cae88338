"""A decode replica's import with ``llm.kv_transfer: collective`` (``DecodeImports`` with ``DecodePairs``),
its prefill side a real ``PrefillPairs`` in the same process (the link: a direct call), their bytes on
a real gloo pair group over loopback: the KV lands in the reserved blocks and the request is admitted;
a prefill side that holds no such request fails the import (blocks freed, the pair dropped, the next
import forms a new one); an import cancelled while its receive runs frees its blocks only once the
receive has ended."""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from llm_service.kv_handoff import HandoffPins, HeldKV, ImportSlots, KVHandoff, KVTransferFailed
from llm_service.outputs import RequestOutput
from llm_service.request_spec import LLMRequestSpec
from llm_service.sampling_params import SamplingParams
from llm_service.serve import kv_pair, kv_pair_prefill
from llm_service.serve.handoff import DecodeImports, TransferStats

TIMEOUT_S = 1.5


def _runner(seed: int) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randn(2, 8, 4, 2, 8, generator=g), torch.randn(2, 8, 4, 1, 16, generator=g)]
    return SimpleNamespace(kv_caches=caches, window=None, linear_states=None, device=torch.device("cpu"))


async def _on_engine(fn: Any, *args: Any) -> Any:
    return fn(*args)


class _DecodeEngine:
    def __init__(self) -> None:
        self.runner = _runner(seed=1)
        self.log: list[str] = []

    def reserve_import(self, *args: Any) -> ImportSlots:
        return ImportSlots(hit_blocks=0, block_ids=[2, 3, 6])

    def cancel_import(self, request_id: str) -> None:
        self.log.append(f"freed {request_id}")

    def admit_import(self, request_id: str, snapshot: bool, first: object) -> None:
        self.log.append(f"admitted {request_id}")


class _Link:
    """The decode side's link to the prefill side: calls its ``PrefillPairs`` directly."""

    def __init__(self, pairs: kv_pair_prefill.PrefillPairs) -> None:
        self.pairs = pairs

    async def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        return await {"kv_pair_join": self.pairs.join, "kv_send": self.pairs.send}[method](*args)


def _sides() -> tuple[DecodeImports, _DecodeEngine, SimpleNamespace]:
    released: list[str] = []

    async def address() -> tuple[str, int]:
        return ("127.0.0.1", 1)

    h = SimpleNamespace(
        engine=SimpleNamespace(runner=_runner(seed=0), release_handoff=released.append),
        loop=SimpleNamespace(on_engine=_on_engine),
        pins=HandoffPins(),
        early=SimpleNamespace(holds=lambda rid: False),
        stats=TransferStats(),
        replica_id="prefill",
        deadline_s=30.0,
        address=address,
        released=released,
    )
    h.pairs = kv_pair_prefill.PrefillPairs(h)  # type: ignore[arg-type]
    engine, stats = _DecodeEngine(), TransferStats()
    pairs = kv_pair.DecodePairs(engine, address, TIMEOUT_S, stats, "decode")  # type: ignore[arg-type]
    link = _Link(h.pairs)
    loop = SimpleNamespace(on_engine=_on_engine, track=lambda rid: None)
    imports = DecodeImports(loop, engine, lambda _addr: link, TIMEOUT_S, stats, "decode", pairs)  # type: ignore[arg-type]
    return imports, engine, h


def _spec(rid: str) -> LLMRequestSpec:
    first = RequestOutput(rid, [7], None, False, None, 12, 0)
    handoff = KVHandoff(rid, "prefill", first, ("127.0.0.1", 1), 12, 3, (), 30.0)
    return LLMRequestSpec(rid, list(range(12)), SamplingParams(), handoff=handoff)


def test_blocks_arrive_a_failure_frees_and_drops_and_the_next_import_forms_a_new_pair() -> None:
    imports, engine, h = _sides()
    h.pins.pin("r1", HeldKV([5, 6, 7]), 30.0)
    h.pins.pin("r3", HeldKV([1, 0, 4]), 30.0)

    async def run() -> None:
        await imports.import_request(_spec("r1"))
        with pytest.raises(KVTransferFailed, match="no KV held on prefill replica"):
            await imports.import_request(_spec("r2"))  # never handed off there
        await imports.import_request(_spec("r3"))
        while h.pairs._sends:
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert engine.log == ["admitted r1", "freed r2", "admitted r3"]
    sender, got = h.engine.runner.kv_caches, engine.runner.kv_caches
    for layer in range(2):  # r3's blocks 1, 0, 4 in 2, 3, 6 (r1's were there before)
        assert torch.equal(got[layer][:, [2, 3, 6]], sender[layer][:, [1, 0, 4]])
    s = imports.stats
    assert (s.imports, s.failed_imports, s.pairs_formed, s.pairs_dropped) == (2, 1, 2, 1)
    per_request = 3 * 2 * 4 * (2 * 8 + 16) * 4
    assert s.bytes_collective == s.bytes_pulled == 2 * per_request and s.blocks_pulled == 6
    assert len(h.pins) == 0 and sorted(h.released) == ["r1", "r3"]


def test_a_cancelled_import_frees_its_blocks_only_after_its_receive_ended(monkeypatch: Any) -> None:
    imports, engine, h = _sides()
    h.pins.pin("r", HeldKV([5, 6, 7]), 30.0)

    def stalled(*args: object) -> int:  # the prefill side never sends: the receive ends at its timeout
        time.sleep(TIMEOUT_S + 0.5)
        raise RuntimeError("stalled")

    monkeypatch.setattr(kv_pair_prefill, "send_tensors", stalled)
    real_recv = kv_pair.recv_tensors
    receiving = asyncio.Event()

    def recv(*args: Any) -> int:
        loop.call_soon_threadsafe(receiving.set)
        try:
            return real_recv(*args)
        finally:
            engine.log.append("receive ended")

    monkeypatch.setattr(kv_pair, "recv_tensors", recv)

    async def run() -> None:
        task = asyncio.ensure_future(imports.import_request(_spec("r")))
        await receiving.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        while h.pairs._sends:
            await asyncio.sleep(0.01)

    loop = asyncio.new_event_loop()
    loop.run_until_complete(run())
    loop.close()
    assert engine.log == ["receive ended", "freed r"]
    assert imports.stats.pairs_dropped == 1 and len(imports.pairs or ()) == 0
    assert len(h.pins) == 0 and h.released == ["r"]  # the prefill side's pin ended with its failed send


def test_an_import_waiting_on_a_pair_that_fails_under_it_goes_on_on_a_new_pair() -> None:
    imports, engine, h = _sides()
    h.pins.pin("ok", HeldKV([5, 6, 7]), 30.0)

    async def run() -> list[BaseException | None]:
        out = await asyncio.gather(
            imports.import_request(_spec("missing")),
            imports.import_request(_spec("ok")),
            return_exceptions=True,
        )
        while h.pairs._sends:
            await asyncio.sleep(0.01)
        return out

    bad, good = asyncio.run(run())
    assert isinstance(bad, KVTransferFailed) and good is None
    assert engine.log == ["freed missing", "admitted ok"]
    assert (imports.stats.pairs_formed, imports.stats.pairs_dropped) == (2, 1)
    assert torch.equal(engine.runner.kv_caches[0][:, [2, 3, 6]], h.engine.runner.kv_caches[0][:, [5, 6, 7]])


def test_a_prefill_side_whose_cache_takes_another_backend_refuses_the_pair() -> None:
    imports, engine, h = _sides()
    h.engine.runner.device = torch.device("cuda")  # its cache on CUDA: NCCL; the decode side's on CPU
    h.pins.pin("r", HeldKV([5, 6, 7]), 30.0)
    with pytest.raises(
        KVTransferFailed, match="a gloo pair group asked of prefill replica prefill, whose KV"
    ):
        asyncio.run(imports.import_request(_spec("r")))
    assert engine.log == ["freed r"] and imports.stats.pairs_formed == 0 and len(h.pairs) == 0
