"""The prefill side of ``llm.kv_transfer: collective`` (llm_service/serve/kv_pair.py has the picture):
``PrefillPairs``, the pair groups decode replicas formed with this replica, and its sends of a handed-off
request's KV straight out of its pinned blocks, after checking the decode side's ask against the pin."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import torch

from llm_service.kv_collective import kv_parts, nbytes, send_tensors
from llm_service.kv_handoff import KVTransferFailed
from llm_service.serve.kv_pair import (
    DECODE_RANK,
    PREFILL_RANK,
    PairGroup,
    PairOffer,
    SendAsk,
    SendPlan,
    backend_for,
    build_group,
    join_store,
    timed,
)

if TYPE_CHECKING:
    from llm_service.serve.handoff import PrefillHandoffs

logger = logging.getLogger("mmserve.llm")


class PrefillPairs:
    """A prefill replica's pair groups, by id, and its sends out of pinned blocks."""

    def __init__(self, handoffs: PrefillHandoffs) -> None:
        self.h = handoffs
        self._pairs: dict[str, PairGroup] = {}
        self._by_decode: dict[str, str] = {}  # a decode replica's id -> its current pair's id
        self._sends: set[asyncio.Task[None]] = set()
        self._forming: dict[str, asyncio.Task[None]] = {}  # pair id -> this side's build, until it ends

    def __len__(self) -> int:
        return len(self._pairs)

    async def join(self, offer: PairOffer) -> None:
        """Accept the decode replica's offer and start building this side of its pair group (rank 0):
        answered at once (the decode side then builds its own, and both meet in the store), refused
        at once where this replica's cache takes another backend. The group replaces the decode
        replica's older one once built; a ``send`` on it waits for that."""
        mine = backend_for(self.h.engine.runner.device)
        if offer.backend != mine:
            raise KVTransferFailed(
                f"a {offer.backend} pair group asked of prefill replica {self.h.replica_id}, "
                f"whose KV cache takes {mine}"
            )
        host = (await self.h.address())[0]
        task = asyncio.get_running_loop().create_task(self._build(offer, host, mine))
        self._forming[offer.pair_id] = task
        task.add_done_callback(lambda _: self._forming.pop(offer.pair_id, None))

    async def _build(self, offer: PairOffer, host: str, backend: str) -> None:
        try:
            store = await asyncio.to_thread(join_store, offer.host, offer.port, offer.timeout_s)
            group = await asyncio.to_thread(
                build_group, store, offer.pair_id, PREFILL_RANK, backend, host, offer.timeout_s
            )
        except Exception as e:  # the decode side's build failed or timed out too: its import fails there
            logger.warning("pair group %s with %s failed to form: %r", offer.pair_id, offer.decode_id, e)
            return
        if (old := self._by_decode.pop(offer.decode_id, None)) is not None:
            self._drop(old)
        self._pairs[offer.pair_id] = PairGroup(offer.pair_id, group, store)
        self._by_decode[offer.decode_id] = offer.pair_id
        self.h.stats.pairs_formed += 1

    def _drop(self, pair_id: str) -> None:
        pair = self._pairs.pop(pair_id, None)
        if pair is not None and not pair.dropped:
            pair.drop()
            self.h.stats.pairs_dropped += 1

    async def send(self, ask: SendAsk) -> SendPlan:
        """Check ``ask`` against the request's pin and start sending its KV on the pair's group (the
        answer comes first: the decode side then posts its receives); the pin ends with the send."""
        h, rid = self.h, ask.request_id
        if (forming := self._forming.get(ask.pair_id)) is not None:  # the decode side built first
            await asyncio.shield(forming)
        pair = self._pairs.get(ask.pair_id)
        if pair is None or pair.dropped:
            raise KVTransferFailed(f"{rid}: no pair group {ask.pair_id} on prefill replica {h.replica_id}")
        if ask.seq != pair.seq:
            self._drop(ask.pair_id)
            raise KVTransferFailed(f"{rid}: transfer {ask.seq} asked on pair {ask.pair_id}, {pair.seq} due")
        if h.early.holds(rid):
            raise KVTransferFailed(f"{rid}: an early hand-off (kv_pull_chunks) moves over the link only")
        held = h.pins.take(rid)
        if held is None:
            raise KVTransferFailed(
                f"{rid}: no KV held on prefill replica {h.replica_id} (never handed off here, "
                f"pulled already, or past its {h.deadline_s} s deadline)"
            )
        try:
            ids, window = held.block_ids[ask.from_block :], held.window_ids[ask.window_from :]
            if held.window_ids and ask.window_from < held.window_first:
                raise KVTransferFailed(
                    f"{rid}: window blocks from {ask.window_from}, held from {held.window_first}"
                )
            if (len(ids), len(window), held.state_slot is not None) != (
                len(ask.block_ids),
                len(ask.window_ids),
                ask.state,
            ):
                raise KVTransferFailed(
                    f"{rid}: {len(ask.block_ids)} blocks, {len(ask.window_ids)} window blocks, state "
                    f"{ask.state} asked; held {len(ids)}, {len(window)}, {held.state_slot is not None}"
                )
            states = [] if held.state_slot is None else [held.state_slot]
            if states and ask.snapshot and held.snapshot_slot is not None:
                states.append(held.snapshot_slot)
            parts = kv_parts(h.engine.runner, ids, window, states, ask.block_ids, ask.window_ids)
        except BaseException:
            await self._release(rid)
            raise
        pair.seq += 1
        task = asyncio.get_running_loop().create_task(self._send(pair, rid, parts))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)
        return SendPlan(tuple(ids), tuple(window), len(states), nbytes(parts))

    async def _send(self, pair: PairGroup, rid: str, parts: list[torch.Tensor]) -> None:
        try:
            async with pair.lock:
                _, cpu_s = await asyncio.to_thread(timed, send_tensors, parts, DECODE_RANK, pair.group)
            self.h.stats.export_cpu_s += cpu_s
        except Exception as e:
            logger.warning("KV send of %s on pair group %s failed: %r", rid, pair.pair_id, e)
            self._drop(pair.pair_id)
        finally:
            await self._release(rid)

    async def _release(self, rid: str) -> None:
        self.h.stats.pulls += 1
        if self.h.pins.done(rid):
            await self.h.loop.on_engine(self.h.engine.release_handoff, rid)
