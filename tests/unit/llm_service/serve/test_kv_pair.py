"""``llm.kv_transfer: collective`` (llm_service/serve/kv_pair.py, kv_pair_prefill.py) between two processes on gloo over
loopback: a decode side (``DecodePairs``) and a prefill side (``PrefillPairs``), their control calls on a
pipe standing in for the link, their bytes on the pair group they form. Three layers (a full one, a
sliding-window one with its own block ids, a narrower full one) and a hybrid's state slots move
straight from the prefill side's pinned blocks into the decode side's reserved ones; the second hand-off
reuses the pair; a stalled send times out on the decode side, drops the pair on both sides and frees
the pin; the next hand-off forms a new pair and moves its KV."""

from __future__ import annotations

import asyncio
import os
import pickle
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from llm_service.kv_handoff import HandoffPins, HeldKV, ImportSlots, KVTransferFailed

SHAPES = [(2, 10, 4, 2, 8), (2, 6, 4, 2, 8), (2, 10, 4, 1, 16)]  # (K|V, blocks, block_size, heads, dim)
WINDOWS = [None, 8, None]  # the second layer is a sliding-window layer: its own (window group's) blocks
STATE = [((3, 5), (2, 4, 4))]  # one linear layer: conv and recurrent state per slot
TIMEOUT_S = 3.0
# request -> (prefill side's HeldKV, decode side's ImportSlots)
HANDOFFS = {
    # blocks 3, 4 -> 5, 6 and window blocks 2, 3 -> 1, 2: consecutive on both sides, one op each run
    "r1": (HeldKV([3, 4, 1, 7], [0, 2, 3], 1, 1, 2), ImportSlots(0, [5, 6, 2, 0], 1, [1, 2], 0, 3)),
    "r2": (HeldKV([8, 9], [4], 0, 3, None), ImportSlots(1, [7], 0, [4], 1, None)),
    "stall": (HeldKV([2, 6], [1], 0, 0, None), ImportSlots(0, [1, 8], 0, [0], 2, None)),
    "r3": (HeldKV([5, 0], [3], 0, 0, 2), ImportSlots(0, [9, 4], 0, [5], 2, None)),
}


def runner(seed: int) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    states = SimpleNamespace(
        conv=[torch.randn(4, *c, generator=g) for c, _ in STATE],
        recurrent=[torch.randn(4, *r, generator=g) for _, r in STATE],
    )
    return SimpleNamespace(
        kv_caches=[torch.randn(s, generator=g) for s in SHAPES],
        window=8,
        text_config=SimpleNamespace(kv_layer_windows=lambda: WINDOWS),
        linear_states=states,
        device=torch.device("cpu"),
    )


class PipeLink:
    """The decode side's link to the prefill side (a pipe; the direct link in serving)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    async def call(self, method: str, *args: object, timeout_s: float | None = None) -> Any:
        self.conn.send((method, args))
        ok, value = await asyncio.to_thread(self.conn.recv)
        if not ok:
            raise value
        return value


def prefill_main(conn: Connection, out: str) -> None:
    from llm_service.serve import kv_pair_prefill

    released: list[str] = []

    async def on_engine(fn: Any, *args: object) -> Any:
        return fn(*args)

    h = SimpleNamespace(
        engine=SimpleNamespace(runner=runner(seed=0), release_handoff=released.append),
        loop=SimpleNamespace(on_engine=on_engine),
        pins=HandoffPins(),
        early=SimpleNamespace(holds=lambda rid: False),
        stats=SimpleNamespace(pulls=0, export_cpu_s=0.0, pairs_formed=0, pairs_dropped=0),
        replica_id="prefill",
        deadline_s=30.0,
    )

    async def address() -> tuple[str, int]:
        return ("127.0.0.1", 1)

    h.address = address
    for rid, (held, _) in HANDOFFS.items():
        h.pins.pin(rid, held, 30.0)
    pairs = kv_pair_prefill.PrefillPairs(h)  # type: ignore[arg-type]
    real_send = kv_pair_prefill.send_tensors

    def stalled(*args: object) -> int:  # a prefill side that never sends: the decode side's timeout
        time.sleep(TIMEOUT_S + 1)
        raise RuntimeError("stalled")

    async def serve() -> None:
        while True:
            method, args = await asyncio.to_thread(conn.recv)
            if method == "stop":
                await asyncio.sleep(0.2)  # the last send's release
                break
            kv_pair_prefill.send_tensors = (
                stalled if getattr(args[0], "request_id", "") == "stall" else real_send
            )  # type: ignore[attr-defined]
            try:
                value = await getattr(pairs, {"kv_pair_join": "join", "kv_send": "send"}[method])(*args)
                conn.send((True, value))
            except Exception as e:
                conn.send((False, e))
        while pairs._sends:
            await asyncio.sleep(0.05)

    asyncio.run(serve())
    result = {"released": released, "pins": len(h.pins), "stats": vars(h.stats), "pairs": len(pairs)}
    (Path(out) / "prefill.pkl").write_bytes(pickle.dumps(result))
    sys.stdout.flush()
    os._exit(0)


def decode_main(conn: Connection, out: str) -> None:
    from llm_service.serve.handoff import TransferStats
    from llm_service.serve.kv_pair import DecodePairs

    async def address() -> tuple[str, int]:
        return ("127.0.0.1", 2)

    r, stats = runner(seed=1), TransferStats()
    pairs = DecodePairs(SimpleNamespace(runner=r), address, TIMEOUT_S, stats, "decode")  # type: ignore[arg-type]
    link = PipeLink(conn)
    outcomes: dict[str, Any] = {}

    async def run() -> None:
        for rid, (_, slots) in HANDOFFS.items():
            writes: list[Any] = []
            try:
                got = await pairs.pull(link, ("127.0.0.1", 1), rid, slots, slots.hit_blocks, writes)
                outcomes[rid] = (got.num_blocks, got.nbytes, got.snapshot, stats.pairs_formed, len(pairs))
            except KVTransferFailed as e:
                outcomes[rid] = (str(e), stats.pairs_dropped, len(pairs))
        conn.send(("stop", ()))

    asyncio.run(run())
    torch.save(
        {"caches": r.kv_caches, "conv": r.linear_states.conv, "rec": r.linear_states.recurrent},
        Path(out) / "d.pt",
    )
    (Path(out) / "decode.pkl").write_bytes(pickle.dumps({"outcomes": outcomes, "stats": stats}))
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.slow
def test_pair_group_moves_blocks_window_and_states_reuses_drops_and_reforms(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    procs = [
        ctx.Process(target=prefill_main, args=(a, str(tmp_path))),
        ctx.Process(target=decode_main, args=(b, str(tmp_path))),
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    dec = pickle.loads((tmp_path / "decode.pkl").read_bytes())
    pre = pickle.loads((tmp_path / "prefill.pkl").read_bytes())
    got = torch.load(tmp_path / "d.pt")
    sender, before = runner(seed=0), runner(seed=1)
    o = dec["outcomes"]
    # r1: 4 blocks, 2 window blocks (from the held window's first), the state and the snapshot
    per_block = [2 * 4 * 2 * 8 * 4, 2 * 4 * 2 * 8 * 4, 2 * 4 * 1 * 16 * 4]
    states = (3 * 5 + 2 * 4 * 4) * 4
    assert o["r1"] == (4, 4 * (per_block[0] + per_block[2]) + 2 * per_block[1] + 2 * states, True, 1, 1)
    assert o["r2"][:4] == (1, per_block[0] + per_block[2] + per_block[1] + states, False, 1)  # the same pair
    assert "KV receive on the pair group failed" in o["stall"][0] and o["stall"][1:] == (1, 0)  # dropped
    assert o["r3"][2:] == (False, 2, 1)  # a new pair; no snapshot where this side reserved no slot for it
    moved = {  # decode block <- prefill block, per group
        "full": [(5, 3), (6, 4), (2, 1), (0, 7), (7, 9), (9, 5), (4, 0)],
        "window": [(1, 2), (2, 3), (4, 4), (5, 3)],
    }
    for layer, w in enumerate(WINDOWS):
        for d, s in moved["window" if w else "full"]:
            assert torch.equal(got["caches"][layer][:, d], sender.kv_caches[layer][:, s]), (layer, d, s)
        touched = {d for d, _ in moved["window" if w else "full"]} | ({0} if w else {1, 8})  # stall's: any
        for blk in set(range(SHAPES[layer][1])) - touched:
            assert torch.equal(got["caches"][layer][:, blk], before.kv_caches[layer][:, blk])
    for kind in ("conv", "rec"):
        src = sender.linear_states.conv if kind == "conv" else sender.linear_states.recurrent
        for d, s in [(0, 1), (3, 2), (1, 3)]:  # r1's state and snapshot, r2's state
            assert torch.equal(got[kind][0][d], src[0][s])
        assert torch.equal(got[kind][0][2], src[0][0])  # r3's (the stalled one's slot, overwritten)
    assert (pre["pins"], sorted(pre["released"])) == (0, sorted(HANDOFFS))  # every pin ended, stall's too
    assert pre["stats"]["pairs_formed"] == 2 and pre["stats"]["pairs_dropped"] == 1 and pre["pairs"] == 1
    assert dec["stats"].bytes_collective == o["r1"][1] + o["r2"][1] + o["r3"][1]


def test_runs_are_cut_alike_from_either_side_and_each_is_one_part() -> None:
    from llm_service.kv_collective import kv_parts, runs

    src, dst = [3, 4, 5, 1, 7, 8], [5, 6, 7, 2, 0, 1]
    assert runs(src, dst) == runs(dst, src) == [(0, 3), (3, 1), (4, 2)]
    r = runner(seed=0)
    window_src, window_dst = [2, 3], [1, 2]
    parts = kv_parts(r, src, window_src, [1], peer_block_ids=dst, peer_window_ids=window_dst)
    # two full layers x K|V x 3 runs, the window layer x K|V x 1 run, the state's conv and recurrent
    assert len(parts) == 2 * 2 * 3 + 2 * 1 + 2
    assert torch.equal(parts[0], r.kv_caches[0][0, 3:6]) and torch.equal(parts[3], r.kv_caches[0][1, 3:6])
    assert len(kv_parts(r, src, window_src, [1])) == 2 * 2 * 6 + 2 * 2 + 2  # no peer ids: one part a block
    with pytest.raises(ValueError, match="different numbers of blocks"):
        kv_parts(r, src, window_src, peer_block_ids=dst[:-1], peer_window_ids=window_dst)
