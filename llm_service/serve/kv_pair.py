"""E/P/D's KV hand-off over ``torch.distributed`` (``llm.kv_transfer: collective``): a two-rank process
group per (decode replica, prefill replica), formed on their first hand-off and kept for the next.

There is no global world: replicas come and go as Serve scales their pools, so each pair builds its
own group from torch's direct constructors (a ``TCPStore`` the decode side hosts, a ``PrefixStore``
under a random id, ``ProcessGroupGloo`` or ``ProcessGroupNCCL`` of size 2), as vLLM's stateless groups
do. The link (authenticated) carries the control, the group carries the bytes::

  decode replica (rank 1)                                        prefill replica (rank 0)
  TCPStore on its node's address, port 0 ──kv_pair_join(offer)──▶ accepted; joins the store:
  builds its rank of the group ◀════ the two meet in the store ════▶ builds its rank of the group
  blocks reserved (ImportSlots)           ──kv_send(ask, seq)───▶ pin taken, counts and seq checked:
                                          ◀──SendPlan──────────── what it will send (blocks, states)
  recv straight into its reserved blocks  ◀══ group: every part ══ send straight out of its pinned blocks
  registered under the same hashes                                pin released (blocks stay as cache)

One transfer at a time per pair (the decode side holds the pair's lock from ``kv_send`` to the end of
its receive; the prefill side's sends queue on its own lock), numbered on both sides (``seq``): a
number out of step drops the pair. Sends and receives run on worker threads, never on the event loop
or the engine's thread. A failed or timed-out transfer (the group's timeout is the decode side's
``kv_transfer_timeout_s``) drops the pair on the side that saw it (the next hand-off forms a new one),
frees the decode side's blocks (``DecodeImports``) and releases the prefill side's pin.

What crosses the group is unauthenticated and unencrypted (TCPStore, gloo and NCCL have neither):
``collective`` is for a trusted cluster network only (docs/disaggregation.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import PrefixStore, TCPStore

from llm_service.kv_collective import kv_parts, nbytes, recv_tensors
from llm_service.kv_handoff import ImportSlots, KVTransferFailed

if TYPE_CHECKING:
    from llm_service.engine import LLMEngine
    from llm_service.serve.handoff import KVSource, TransferStats

logger = logging.getLogger("mmserve.llm")

Address = tuple[str, int]
PREFILL_RANK, DECODE_RANK = 0, 1


@dataclass(frozen=True)
class PairOffer:
    """The decode side's invitation: where its store listens, the pair's id (the store's key prefix)."""

    pair_id: str
    host: str
    port: int
    backend: str  # "nccl" (the decode replica's cache on CUDA) or "gloo"
    timeout_s: float
    decode_id: str  # a newer pair from the same decode replica replaces the older one


@dataclass(frozen=True)
class SendAsk:
    """The decode side's ask for one request's KV on pair ``pair_id``, the pair's ``seq``-th transfer:
    what it reserved (``ImportSlots``), so the prefill side checks it holds as much before sending."""

    request_id: str
    pair_id: str
    seq: int
    from_block: int
    window_from: int
    block_ids: tuple[int, ...]  # the decode side's blocks it receives into (runs are cut on both sides' ids)
    window_ids: tuple[int, ...]
    state: bool  # it reserved a state slot (a hybrid model)
    snapshot: bool  # and a snapshot slot (its cache lacks the prompt's last full block's snapshot)


@dataclass(frozen=True)
class SendPlan:
    """The prefill side's answer: what it sends on the group, in ``kv_parts`` order."""

    block_ids: tuple[int, ...]  # the prefill side's blocks it sends out of
    window_ids: tuple[int, ...]
    state_slots: int  # 0, 1 (the request's state) or 2 (and the snapshot)
    nbytes: int

    @property
    def snapshot(self) -> bool:
        return self.state_slots == 2


@dataclass
class PairGroup:
    pair_id: str
    group: Any  # a ProcessGroupGloo or ProcessGroupNCCL of two ranks
    store: Any  # kept alive with the group
    seq: int = 0  # the next transfer's number
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    dropped: bool = False

    def drop(self) -> None:
        self.dropped = True
        for name in ("abort", "shutdown"):  # NCCL: its communicator; gloo has nothing to free
            if callable(fn := getattr(self.group, name, None)):
                with contextlib.suppress(Exception):  # already broken: nothing more to free
                    fn()
                break


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _timedelta(timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_s)


def host_store(host: str, timeout_s: float) -> TCPStore:
    """The decode side's store, on ``host`` at an ephemeral port (``.port``)."""
    return TCPStore(host, 0, None, True, _timedelta(timeout_s), wait_for_workers=False)


def join_store(host: str, port: int, timeout_s: float) -> TCPStore:
    return TCPStore(host, port, None, False, _timedelta(timeout_s))


def build_group(store: TCPStore, pair_id: str, rank: int, backend: str, host: str, timeout_s: float) -> Any:
    """The pair's two-rank group (blocks until the other rank builds its own, or the timeout)."""
    prefixed = PrefixStore(f"mmserve-kv/{pair_id}/", store)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        gloo = ProcessGroupGloo._Options()
        gloo._timeout = _timedelta(timeout_s)
        gloo._devices = [ProcessGroupGloo.create_device(hostname=host)]
        return ProcessGroupGloo(prefixed, rank, 2, gloo)
    from torch.distributed import ProcessGroupNCCL

    nccl = ProcessGroupNCCL.Options()
    nccl._timeout = _timedelta(timeout_s)
    return ProcessGroupNCCL(prefixed, rank, 2, nccl)


def timed(fn: Callable[..., int], *args: object) -> tuple[int, float]:
    """``fn(*args)`` and the CPU time of the thread that ran it (call it in the worker thread)."""
    t0 = time.thread_time()
    out = fn(*args)
    return out, time.thread_time() - t0


@dataclass(frozen=True)
class Received:
    """What a decode side's collective transfer brought: counted into ``TransferStats``."""

    num_blocks: int
    nbytes: int
    snapshot: bool


class DecodePairs:
    """A decode replica's pair groups, one per prefill replica (by its link address), and its receives."""

    def __init__(
        self,
        engine: LLMEngine,
        own_address: Callable[[], Awaitable[Address]],
        timeout_s: float,
        stats: TransferStats,
        replica_id: str,
    ) -> None:
        self.engine, self._own_address = engine, own_address
        self.timeout_s, self.stats, self.replica_id = timeout_s, stats, replica_id
        self.backend = backend_for(engine.runner.device)
        self._pairs: dict[Address, PairGroup] = {}
        self._forming: dict[Address, asyncio.Lock] = {}

    def __len__(self) -> int:
        return len(self._pairs)

    async def pair(self, address: Address, link: KVSource) -> PairGroup:
        """The pair group with the prefill replica at ``address``, formed now if there is none."""
        async with self._forming.setdefault(address, asyncio.Lock()):
            pair = self._pairs.get(address)
            if pair is not None and not pair.dropped:
                return pair
            host = (await self._own_address())[0]
            pair_id = secrets.token_hex(8)
            store = await asyncio.to_thread(host_store, host, self.timeout_s)
            offer = PairOffer(pair_id, host, int(store.port), self.backend, self.timeout_s, self.replica_id)
            try:  # answered at once: the prefill side builds its own in the background
                await link.call("kv_pair_join", offer, timeout_s=self.timeout_s)
                group = await asyncio.to_thread(
                    build_group, store, pair_id, DECODE_RANK, self.backend, host, self.timeout_s
                )
            except Exception as e:
                raise KVTransferFailed(f"pair group with {address}: {e}") from e
            pair = PairGroup(pair_id, group, store)
            self._pairs[address] = pair
            self.stats.pairs_formed += 1
            return pair

    def drop(self, address: Address, pair: PairGroup) -> None:
        if self._pairs.get(address) is pair:
            del self._pairs[address]
        if not pair.dropped:
            pair.drop()
            self.stats.pairs_dropped += 1

    async def pull(
        self,
        link: KVSource,
        address: Address,
        rid: str,
        slots: ImportSlots,
        from_block: int,
        writes: list[asyncio.Future[Any]],
    ) -> Received:
        """Blocks ``from_block..`` (the window's, the states) received straight into ``slots``; a
        failure drops the pair and raises (the caller frees the blocks once ``writes`` ended)."""
        for _ in range(3):
            pair = await self.pair(address, link)
            async with pair.lock:
                if pair.dropped:  # an earlier transfer on it failed while this one waited: a new one
                    continue
                try:
                    return await self._pull_on(pair, link, rid, slots, from_block, writes)
                except BaseException:
                    self.drop(address, pair)
                    raise
        raise KVTransferFailed(
            f"{rid}: the pair group with {address} was dropped three times while it waited"
        )

    async def _pull_on(
        self,
        pair: PairGroup,
        link: KVSource,
        rid: str,
        slots: ImportSlots,
        from_block: int,
        writes: list[asyncio.Future[Any]],
    ) -> Received:
        ids = slots.block_ids[from_block - slots.hit_blocks :]
        ask = SendAsk(
            rid,
            pair.pair_id,
            pair.seq,
            from_block,
            slots.window_from,
            tuple(ids),
            tuple(slots.window_ids),
            slots.state_slot is not None,
            slots.snapshot_slot is not None,
        )
        pair.seq += 1
        plan = await link.call("kv_send", ask, timeout_s=self.timeout_s)
        if not isinstance(plan, SendPlan):
            raise KVTransferFailed(f"{rid}: kv_send answered a {type(plan).__name__}")
        states = [s for s in (slots.state_slot, slots.snapshot_slot) if s is not None][: plan.state_slots]
        try:
            parts = kv_parts(
                self.engine.runner, ids, slots.window_ids, states, plan.block_ids, plan.window_ids
            )
        except ValueError as e:
            raise KVTransferFailed(f"{rid}: the prefill side sends {plan}: {e}") from e
        if (len(states), plan.nbytes) != (plan.state_slots, nbytes(parts)):
            raise KVTransferFailed(f"{rid}: the prefill side sends {plan}, this side holds {len(ids)} blocks")
        recv = asyncio.ensure_future(asyncio.to_thread(timed, recv_tensors, parts, PREFILL_RANK, pair.group))
        writes.append(recv)  # the blocks are the thread's until it has received
        try:
            received, cpu_s = await asyncio.shield(recv)
        except Exception as e:
            raise KVTransferFailed(f"{rid}: KV receive on the pair group failed: {e}") from e
        self.stats.import_cpu_s += cpu_s
        self.stats.bytes_collective += received
        return Received(len(ids), received, plan.snapshot)
