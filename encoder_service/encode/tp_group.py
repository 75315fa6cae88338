"""EncoderTPGroup: one encoder TP group as Ray actors in one placement group.

::

    caller (Serve replica) ──encode(items)──▶ rank 0 actor ─┐
                            └─same items───▶ rank 1 actor ─┤ torch.distributed (NCCL / gloo)
                            └─same items───▶ rank N-1     ─┘
    result: rank 0's list of tensors (the other ranks return None)

Rank 0 picks a free port on its node and the others join ``tcp://<rank-0 host>:<port>``. All ranks
must run every batch in the same order: batches are submitted to all ranks under a lock, and Ray
runs one caller's calls on an actor in submission order, so concurrent ``encode`` calls pipeline
safely.

``tp_size == 1`` runs the EncoderRunner in the caller's process (no actor, no placement group): the
Serve replica that owns the group should itself hold the GPU (``ray_actor_options``).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import TypedDict, cast

import ray
import torch
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from encoder_service.encode.runner import EncoderRunner, TPMode
from encoder_service.encode.tp.launch import (
    default_backend,
    free_port,
    init_tp_process_group,
    leave_tp_process_group,
)
from encoder_service.types import EncoderInput

# Bounds on each start-up step, so a group that cannot form fails (and Serve retries the replica)
# instead of hanging. Under heavy CPU contention a rank actor was once seen never to start.
PLACEMENT_TIMEOUT_S = 600.0  # a self-made group may wait for the cluster autoscaler to add a node
RANK_START_TIMEOUT_S = 120.0  # actors into bundles that are already reserved
LOAD_TIMEOUT_S = 900.0  # process-group rendezvous and loading a large tower's weights


def _get(refs: ray.ObjectRef | list[ray.ObjectRef], timeout_s: float, what: str) -> object:
    """``ray.get`` bounded; its callers name what the ranks' methods return (``cast``)."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise RuntimeError(f"encoder TP group: gave up after {timeout_s:.0f} s waiting for {what}") from e


class RankInfo(TypedDict):
    """Rank 0's model facts (``EncoderRankWorker.info``)."""

    family: str
    hidden_size: int


class EncoderRankWorker:
    """One TP rank: joins the group, then runs its EncoderRunner on every batch it is sent."""

    def node_address(self) -> tuple[str, str]:
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def pick_port(self, host: str) -> int:
        return free_port(host)

    def start(
        self,
        init_method: str,
        rank: int,
        size: int,
        model_dir: str,
        tp_mode: TPMode,
        dtype: str,
        device: str,
        max_num_encoder_input_tokens: int | None,
    ) -> None:
        torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
        init_tp_process_group(init_method, rank, size, default_backend(device))
        self.rank = rank
        self.runner = EncoderRunner(
            model_dir,
            dtype=dtype,
            device=device,
            tp_rank=rank,
            tp_size=size,
            tp_mode=tp_mode,
            max_num_encoder_input_tokens=max_num_encoder_input_tokens,
        )

    def info(self) -> RankInfo:
        return {"family": self.runner.family, "hidden_size": self.runner.hidden_size}

    def encode(self, inputs: list[EncoderInput]) -> list[torch.Tensor] | None:
        out = self.runner.encode(inputs)
        return [t.cpu() for t in out] if self.rank == 0 else None

    def stop(self) -> None:
        leave_tp_process_group(barrier=False)  # a peer may be gone already


class EncoderTPGroup:
    def __init__(
        self,
        model_dir: str | Path,
        tp_size: int,
        tp_mode: TPMode = "weights",
        dtype: str = "float32",
        device: str = "auto",
        num_cpus_per_rank: float = 1.0,
        num_gpus_per_rank: float = 0.0,
        resources: dict[str, float] | None = None,
        max_num_encoder_input_tokens: int | None = None,
    ) -> None:
        if tp_size < 1:
            raise ValueError(f"mm_encoder_tp_size must be >= 1, got {tp_size}")
        self.tp_size = tp_size
        self.tp_mode = tp_mode
        self._lock = threading.Lock()
        self._runner: EncoderRunner | None = None
        self._actors: list[ActorHandle] = []
        self._pg: PlacementGroup | None = None
        if tp_size == 1:
            self._runner = EncoderRunner(
                model_dir,
                dtype=dtype,
                device=device,
                tp_mode=tp_mode,
                max_num_encoder_input_tokens=max_num_encoder_input_tokens,
            )
            self.family, self.hidden_size = self._runner.family, self._runner.hidden_size
            return
        pg, first_bundle = self._placement(tp_size, num_cpus_per_rank, num_gpus_per_rank, resources)
        try:
            _get(pg.ready(), PLACEMENT_TIMEOUT_S, "the TP group's placement group to be ready")
            self._actors = [
                ray.remote(EncoderRankWorker)
                .options(
                    num_cpus=num_cpus_per_rank,
                    num_gpus=num_gpus_per_rank,
                    resources=resources or {},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=first_bundle + rank
                    ),
                )
                .remote()
                for rank in range(tp_size)
            ]
            info = self._start_ranks(str(model_dir), tp_mode, dtype, device, max_num_encoder_input_tokens)
        except BaseException:
            self.shutdown()
            raise
        self.family, self.hidden_size = info["family"], info["hidden_size"]

    def _start_ranks(
        self, model_dir: str, tp_mode: TPMode, dtype: str, device: str, max_tokens: int | None
    ) -> RankInfo:
        """Rendezvous at rank 0's node, every rank loads its shard; rank 0's model facts."""
        nodes = cast(
            "list[tuple[str, str]]",  # EncoderRankWorker.node_address's, per rank
            _get(
                [a.node_address.remote() for a in self._actors], RANK_START_TIMEOUT_S, "rank actors to start"
            ),
        )
        # One node: loopback. Several (PACK may spread CPU ranks): rank 0's node IP.
        host = "127.0.0.1" if len({n for n, _ in nodes}) == 1 else nodes[0][1]
        port = cast(
            int, _get(self._actors[0].pick_port.remote(host), RANK_START_TIMEOUT_S, "rank 0 to pick a port")
        )
        init_method = f"tcp://{host}:{port}"
        size = len(self._actors)
        starts = [
            a.start.remote(init_method, rank, size, model_dir, tp_mode, dtype, device, max_tokens)
            for rank, a in enumerate(self._actors)
        ]
        _get(starts, LOAD_TIMEOUT_S, "every rank to join the process group and load its weights")
        return cast(
            RankInfo, _get(self._actors[0].info.remote(), RANK_START_TIMEOUT_S, "rank 0's model info")
        )

    def _placement(
        self, tp_size: int, cpus: float, gpus: float, resources: dict[str, float] | None
    ) -> tuple[PlacementGroup, int]:
        """The placement group the ranks go in, and the bundle index of rank 0.

        Inside a Serve replica deployed with ``placement_group_bundles`` (cluster/app.py), that group
        is the replica's own: bundle 0 holds the replica, bundles 1..tp_size the ranks, so Serve and
        the cluster autoscaler see one replica as one gang with its node markers. Elsewhere (tests,
        scripts) the group makes its own placement group and removes it on shutdown.
        """
        current = ray.util.get_current_placement_group()
        if current is not None:
            if len(current.bundle_specs) < tp_size + 1:
                raise ValueError(
                    f"the replica's placement group has {len(current.bundle_specs)} bundles; "
                    f"mm_encoder_tp_size={tp_size} needs {tp_size + 1} (the replica, then one per rank)"
                )
            return current, 1
        bundle: dict[str, float] = {"CPU": cpus, **(resources or {})}
        if gpus:
            bundle["GPU"] = gpus
        strategy = "STRICT_PACK" if gpus else "PACK"
        self._pg = placement_group([dict(bundle) for _ in range(tp_size)], strategy=strategy)
        return self._pg, 0

    def _submit(self, inputs: list[EncoderInput]) -> ray.ObjectRef:
        """Send the batch to every rank; the ref of rank 0's result."""
        if not self._actors:
            raise RuntimeError("EncoderTPGroup is shut down")
        batch = ray.put(inputs)  # one copy in the object store, read by every rank
        with self._lock:  # the same batch order on every rank
            refs = [a.encode.remote(batch) for a in self._actors]
        # Ranks > 0 return None. Bad input fails validation on every rank before any collective, so
        # rank 0 raises it too; a rank dying mid-batch leaves rank 0 waiting until the group timeout.
        return refs[0]

    def _encode_local(self, inputs: list[EncoderInput]) -> list[torch.Tensor]:
        assert self._runner is not None
        with self._lock:
            return self._runner.encode(inputs)

    def encode(self, inputs: list[EncoderInput]) -> list[torch.Tensor]:
        """Encode on every rank (same items, same order); rank 0's outputs (moved to the CPU if remote)."""
        if self._runner is not None:
            return self._encode_local(inputs)
        return ray.get(self._submit(inputs))

    async def encode_async(self, inputs: list[EncoderInput]) -> list[torch.Tensor]:
        if self._runner is not None:
            return await asyncio.to_thread(self._encode_local, inputs)
        return await self._submit(inputs)

    def shutdown(self) -> None:
        """Kill the rank actors and free the placement group. Safe to call twice."""
        for a in self._actors:
            ray.kill(a)
        self._actors = []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
        self._runner = None
