"""An LLM replica's E/P/D roles (llm_service/kv_handoff.py has the hand-off's picture and books).

``PrefillHandoffs``: a prefill replica's pins of handed-off requests, the pull that reads their
blocks, and the deadline that frees them unpulled. ``DecodeImports``: a decode replica's import of a
request (blocks reserved, KV pulled from the prefill replica over the link the wiring gives, written,
the request run on from its first token). Both drive the engine only through its loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from llm_service.engine_loop import EngineLoop
from llm_service.errors import RequestRejected
from llm_service.kv_handoff import (
    DecodeRefused,
    HandoffPins,
    ImportSlots,
    KVBlocks,
    KVHandoff,
    KVTransferFailed,
)
from llm_service.outputs import RequestOutput
from llm_service.serve.early_handoff import EarlyHandoffs
from llm_service.serve.kv_pair import DecodePairs
from llm_service.serve.kv_pair_prefill import PrefillPairs
from mmcore.errors import Overloaded

if TYPE_CHECKING:
    from llm_service.engine import LLMEngine
    from llm_service.request_spec import LLMRequestSpec

logger = logging.getLogger("mmserve.llm")

Address = tuple[str, int]
T = TypeVar("T")


def _on_thread_timed(fn: Callable[..., T], *args: object) -> tuple[T, float]:
    """``fn(*args)`` and the CPU time of the thread that ran it (call it in the worker thread)."""
    t0 = time.thread_time()
    out = fn(*args)
    return out, time.thread_time() - t0


def rejected(e: BaseException) -> bool:
    """``e`` is the request's own fault, as the prefill replica found it (``RequestRejected``, or any
    coded 4xx): the client gets it as it is, not a retryable failed transfer."""
    status = getattr(e, "status_code", None)
    return isinstance(e, RequestRejected) or (isinstance(status, int) and 400 <= status < 500)


class KVSource(Protocol):
    """A link to a prefill replica (``mmcore.link.DirectLink`` in production)."""

    async def call(self, method: str, *args: object, timeout_s: float | None = None) -> Any: ...


@dataclass
class TransferStats:
    """What the hand-offs of one replica cost, both sides (``stats``: ``kv_*``)."""

    handoffs: int = 0  # prefill side: requests handed off
    pulls: int = 0  # prefill side: pulls served
    expired: int = 0  # prefill side: pins dropped unpulled at their deadline
    abandoned: int = 0  # prefill side: hand-offs the ingress gave up on (freed at once, unpulled)
    imports: int = 0  # decode side: requests imported
    failed_imports: int = 0  # decode side: imports whose pull or write failed (blocks freed)
    refused_imports: int = 0  # decode side: imports refused as overloaded (nothing allocated)
    blocks_pulled: int = 0  # decode side
    blocks_hit: int = 0  # decode side: leading blocks its own prefix cache held (not pulled)
    bytes_pulled: int = 0  # decode side
    import_cpu_s: float = 0.0  # decode side: CPU time of the thread writing pulled blocks
    export_cpu_s: float = 0.0  # prefill side: CPU time of the thread reading blocks out for a pull
    pull_wall_s: float = 0.0  # decode side: from reserving the blocks to the request admitted
    blocks_overlapped: int = 0  # decode side: blocks pulled while their prompt still computed (early)
    bytes_collective: int = 0  # decode side: of bytes_pulled, those received on a pair group (kv_pair.py)
    pairs_formed: int = 0  # both sides: pair groups formed (llm.kv_transfer: collective)
    pairs_dropped: int = 0  # both sides: pair groups dropped after a failed transfer

    def as_dict(self) -> dict[str, float]:
        return {f"kv_{k}": float(v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class _Held:
    """A pinned hand-off's counts for its answer (``KVHandoff``)."""

    num_blocks: int
    block_hashes: tuple[bytes, ...]
    num_window_blocks: int
    num_state_slots: int


class PrefillHandoffs:
    def __init__(
        self,
        loop: EngineLoop,
        engine: LLMEngine,
        replica_id: str,
        address: Callable[[], Awaitable[Address]],
        deadline_s: float,
        stats: TransferStats,
    ) -> None:
        self.loop, self.engine, self.replica_id = loop, engine, replica_id
        self._address = address
        self.deadline_s = deadline_s
        self.pins = HandoffPins()
        self.stats = stats
        self._held: dict[str, _Held] = {}  # pinned, not yet answered
        self.early = EarlyHandoffs(self)  # hand-offs answered before their first token (kv_pull_chunks)
        self.pairs = PrefillPairs(
            self
        )  # pair groups decode replicas formed with it (kv_transfer: collective)

    async def address(self) -> Address:
        return await self._address()

    async def read(self, request_id: str, block_ids: list[int], from_block: int) -> KVBlocks:
        """Full-attention blocks of a request still prefilling (pinned by the caller), read on a thread."""
        blocks, cpu_s = await asyncio.to_thread(
            _on_thread_timed, self.engine.runner.read_kv_blocks, request_id, block_ids, from_block
        )
        self.stats.export_cpu_s += cpu_s
        return blocks

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """After a step (the engine's thread idle): pin each request that left with its first token."""
        self.early.on_step()
        for out in outputs:
            if out.finish_reason == "handoff":
                rid = out.request_id
                held = self.engine.handoff_kv(rid)
                generation = self.pins.pin(rid, held, self.deadline_s)
                self._held[rid] = _Held(
                    len(held.block_ids),
                    tuple(self.engine.handoff_hashes(rid)),
                    len(held.window_ids) - held.window_first if held.window_ids else 0,
                    int(held.state_slot is not None),
                )
                asyncio.get_running_loop().call_later(self.deadline_s, self._expire, rid, generation)
                self.stats.handoffs += 1

    async def handoff(self, spec: LLMRequestSpec, first: RequestOutput) -> KVHandoff:
        """The answer to ``prefill``: the first output and, if it did not end the request, where its KV waits."""
        rid = spec.request_id
        held = self._held.pop(rid, None)
        if first.finish_reason != "handoff" or held is None:
            return KVHandoff(rid, self.replica_id, first)
        return KVHandoff(
            rid,
            self.replica_id,
            replace(first, finished=False, finish_reason=None),
            address=await self._address(),
            num_tokens=first.num_prompt_tokens,
            num_blocks=held.num_blocks,
            block_hashes=held.block_hashes,
            deadline_s=self.deadline_s,
            num_window_blocks=held.num_window_blocks,
            num_state_slots=held.num_state_slots,
        )

    async def pull(self, request_id: str, from_block: int, window_from: int = 0) -> KVBlocks:
        """Blocks ``from_block..`` of a handed-off request (window blocks ``window_from..``, and its
        linear-attention state), read to host memory; the pin ends with it. An early hand-off's pull
        waits for the first output and brings it (alone, no blocks, when it ended the request)."""
        first: RequestOutput | None = None
        hashes: tuple[bytes, ...] = ()
        if self.early.holds(request_id):
            first = await self.early.first(request_id)
            if (early := self._held.pop(request_id, None)) is not None:
                hashes = early.block_hashes
            if first.finish_reason != "handoff":
                return KVBlocks(request_id, from_block, 0, "", [], [], first=first)
            first = replace(first, finished=False, finish_reason=None)
        held = self.pins.take(request_id)
        if held is None:
            raise KVTransferFailed(
                f"{request_id}: no KV held on prefill replica {self.replica_id} (never handed off here, "
                f"pulled already, or past its {self.deadline_s} s deadline)"
            )
        try:
            if held.window_ids and window_from < held.window_first:
                raise KVTransferFailed(
                    f"{request_id}: window blocks from {window_from} asked, held from {held.window_first}"
                )
            blocks, cpu_s = await asyncio.to_thread(
                _on_thread_timed,
                self.engine.runner.read_kv_blocks,
                request_id,
                held.block_ids[from_block:],
                from_block,
                held.window_ids[window_from:],
                window_from,
                held.state_slot,
                held.snapshot_slot,
            )
            self.stats.export_cpu_s += cpu_s
            return blocks if first is None else replace(blocks, first=first, block_hashes=hashes)
        finally:
            self.stats.pulls += 1
            if self.pins.done(request_id):
                await self.loop.on_engine(self.engine.release_handoff, request_id)

    async def abandon(self, request_id: str) -> None:
        """The ingress gave the hand-off up (every decode replica refused it, or its client left):
        its pin ends now, not at the deadline; an early one still prefilling is aborted. A pull in
        progress runs to its end; unknown ids are ignored."""
        early = await self.early.abandon(request_id)
        if early:  # gone from the engine (its blocks freed) when this returns, not at its next step
            await self.loop.on_engine(self.engine.abort, request_id)
        dropped = self.pins.drop(request_id)
        if dropped or early:
            self._held.pop(request_id, None)
            self.stats.abandoned += 1
        if dropped:
            await self.loop.on_engine(self.engine.release_handoff, request_id)

    def _expire(self, request_id: str, generation: int) -> None:
        if self.pins.expire(request_id, generation):
            self._held.pop(request_id, None)
            self.stats.expired += 1
            logger.warning(
                "hand-off of %s was not pulled within %.1f s: blocks freed", request_id, self.deadline_s
            )
            task = asyncio.get_running_loop().create_task(
                self.loop.on_engine(self.engine.release_handoff, request_id)
            )
            task.add_done_callback(lambda t: t.exception())


class DecodeImports:
    def __init__(
        self,
        loop: EngineLoop,
        engine: LLMEngine,
        connect: Callable[[Address], KVSource],
        timeout_s: float,
        stats: TransferStats,
        replica_id: str = "",
        pairs: DecodePairs | None = None,
    ) -> None:
        self.loop, self.engine, self.replica_id = loop, engine, replica_id
        self._connect = connect
        self.timeout_s = timeout_s
        self.stats = stats
        self.pairs = pairs  # llm.kv_transfer: collective: the KV moves on a pair group, not the link

    async def import_request(self, spec: LLMRequestSpec) -> None:
        """Reserve blocks, pull what the prefix cache lacks, write it, run the request on. A failed pull
        or write frees the blocks and raises ``KVTransferFailed``; a pool short of blocks, window
        blocks or a state slot ``DecodeRefused`` (nothing allocated: the ingress tries another)."""
        h = spec.handoff
        assert h is not None and h.address is not None
        from llm_service.embeddings import unfetched

        rid = spec.request_id
        t_start = time.perf_counter()
        try:
            slots = await self.loop.on_engine(
                self.engine.reserve_import,
                rid,
                list(spec.prompt_token_ids),
                spec.sampling_params,
                unfetched(list(spec.mm_items)),
                spec.cache_salt,
                None if h.early else h.first,
                h.block_hashes,
            )
        except Overloaded as e:
            self.stats.refused_imports += 1
            raise DecodeRefused(f"decode replica {self.replica_id}: {e}", self.replica_id) from e
        assert isinstance(slots, ImportSlots)
        writes: list[asyncio.Future[Any]] = []
        pulled, nbytes = 0, 0
        try:
            if self.pairs is not None:  # straight into the reserved blocks, on the pair's group
                got = await self.pairs.pull(
                    self._connect(h.address), h.address, rid, slots, slots.hit_blocks, writes
                )
                blocks = KVBlocks(rid, slots.hit_blocks, 0, "", [], [], snapshot=got.snapshot)
                pulled, nbytes = got.num_blocks, got.nbytes
            else:
                blocks, pulled, nbytes = await self._pull_over_link(h, rid, slots, writes)
        except BaseException as e:
            self.stats.failed_imports += 1
            if writes:  # cancelled mid-write: the blocks are the thread's until it has written
                await asyncio.wait(writes)
                for w in writes:
                    w.exception()  # its own failure, if any, is this one's
            await self.loop.on_engine(self.engine.cancel_import, rid)
            if isinstance(e, KVTransferFailed | asyncio.CancelledError) or rejected(e):
                raise  # a request the prefill side rejected (after an early answer): its 4xx, as it is
            raise KVTransferFailed(
                f"{rid}: KV pull from {h.replica_id} failed: {type(e).__name__}: {e}"
            ) from e
        self.loop.track(rid)
        await self.loop.on_engine(self.engine.admit_import, rid, blocks.snapshot, blocks.first)
        self.stats.imports += 1
        self.stats.blocks_hit += slots.hit_blocks
        self.stats.blocks_pulled += pulled + blocks.num_blocks
        self.stats.bytes_pulled += nbytes + blocks.nbytes
        self.stats.pull_wall_s += time.perf_counter() - t_start

    async def _pull_over_link(
        self, h: KVHandoff, rid: str, slots: ImportSlots, writes: list[asyncio.Future[Any]]
    ) -> tuple[KVBlocks, int, int]:
        """The KV pulled over the link and written on a thread: an early hand-off's chunks as they
        compute, then the last pull; returns the last pull's answer (its blocks counted by the caller)
        and the blocks and bytes of the chunks before it."""
        assert h.address is not None
        pulled, nbytes = 0, 0
        received = slots.hit_blocks  # the blocks this side holds: its hits, then what it pulled
        last: KVBlocks | None = None
        while h.early and last is None:  # the prompt's blocks as the prefill computes them
            part, done = await self._connect(h.address).call(
                "pull_kv_chunks", rid, received, slots.window_from, timeout_s=self.timeout_s
            )
            if done:
                last = self._checked(part, rid, slots, received)
            elif part is not None and part.num_blocks:
                k = received - slots.hit_blocks
                await self._write(writes, slots.block_ids[k : k + part.num_blocks], part)
                received += part.num_blocks
                pulled, nbytes = pulled + part.num_blocks, nbytes + part.nbytes
                self.stats.blocks_overlapped += part.num_blocks
        blocks = last or await self._pull(h, rid, slots, received)
        if blocks.block_hashes:  # an early hand-off's: its hashes came with its last pull
            await self.loop.on_engine(self.engine.check_import_hashes, rid, blocks.block_hashes)
        if blocks.first is None or not blocks.first.finished:
            k = received - slots.hit_blocks
            await self._write(
                writes, slots.block_ids[k:], blocks, slots.window_ids, slots.state_slot, slots.snapshot_slot
            )
        return blocks, pulled, nbytes

    async def _write(
        self,
        writes: list[asyncio.Future[Any]],
        block_ids: list[int],
        blocks: KVBlocks,
        window_ids: list[int] | None = None,
        state_slot: int | None = None,
        snapshot_slot: int | None = None,
    ) -> None:
        """Write pulled blocks on a thread; a cancelled caller still waits for it (``writes``)."""
        write = asyncio.ensure_future(
            asyncio.to_thread(
                _on_thread_timed,
                self.engine.runner.write_kv_blocks,
                block_ids,
                blocks,
                window_ids or [],
                state_slot,
                snapshot_slot,
            )
        )
        writes.append(write)
        _, cpu_s = await asyncio.shield(write)
        self.stats.import_cpu_s += cpu_s

    async def _pull(self, h: KVHandoff, rid: str, slots: ImportSlots, from_block: int) -> KVBlocks:
        """The plain pull (an early hand-off's last one): blocks ``from_block..``, the window's, the state."""
        assert h.address is not None
        link = self._connect(h.address)
        blocks = await link.call("pull_kv", rid, from_block, slots.window_from, timeout_s=self.timeout_s)
        return self._checked(blocks, rid, slots, from_block)

    @staticmethod
    def _checked(blocks: object, rid: str, slots: ImportSlots, from_block: int) -> KVBlocks:
        """A last pull's answer: the blocks from ``from_block`` on (none: the first token ended it)."""
        want = len(slots.block_ids) - (from_block - slots.hit_blocks)
        if not isinstance(blocks, KVBlocks):
            raise KVTransferFailed(f"{rid}: pulled a {type(blocks).__name__}, KV blocks expected")
        if blocks.num_blocks != want and not (blocks.first is not None and blocks.first.finished):
            raise KVTransferFailed(f"{rid}: pulled {blocks.num_blocks} blocks, {want} expected")
        return blocks
