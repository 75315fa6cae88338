"""EncoderRunner: one TP rank's encoder — the family's tower on a device, batching, TP modes.

Every rank of a TP group calls ``encode`` with the same items (the group broadcasts them):

- ``tp_mode="weights"``: each rank holds a shard of every attention/MLP layer and runs every item;
  row-parallel layers all-reduce, so every rank ends with the full output.
- ``tp_mode="data"``: each rank holds the whole tower and runs only its share of the items
  (``split_items_across_ranks``); the outputs are all-gathered and put back in the callers' order.

With ``max_num_encoder_input_tokens`` set, ``encode`` cuts its items into steps that each compute at
most that many embeddings (``plan_encoder_batches``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from encoder_service.encode.batching import plan_encoder_batches, split_items_across_ranks
from encoder_service.encode.models import EncoderModel, load_encoder_model
from encoder_service.encode.tp.parallel import TPContext, all_gather_rows
from encoder_service.types import EncoderInput

TPMode = Literal["weights", "data"]
TP_MODES: tuple[str, ...] = ("weights", "data")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str, tp_rank: int = 0) -> torch.device:
    """``auto``: this rank's GPU (``cuda:<rank mod count>``) when CUDA is present, else the CPU."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", tp_rank % torch.cuda.device_count())
        return torch.device("cpu")
    return torch.device(device)


class EncoderRunner:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        device: str = "auto",
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_mode: TPMode = "weights",
        process_group: dist.ProcessGroup | None = None,
        max_num_encoder_input_tokens: int | None = None,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} not supported; choose one of {', '.join(DTYPES)}")
        if tp_mode not in TP_MODES:
            raise ValueError(f"mm_encoder_tp_mode must be one of {TP_MODES}, got {tp_mode!r}")
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"bad TP rank {tp_rank} for TP size {tp_size}")
        if tp_size > 1:
            if not dist.is_initialized():
                raise RuntimeError("tp_size > 1 needs torch.distributed initialised (init_process_group)")
            world = dist.get_world_size(process_group)
            rank = dist.get_rank(process_group)
            if (world, rank) != (tp_size, tp_rank):
                raise ValueError(
                    f"process group has rank {rank}/{world}, runner was given {tp_rank}/{tp_size}"
                )
        self.model_dir = Path(model_dir)
        self.dtype = DTYPES[dtype]
        self.device = resolve_device(device, tp_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL uses the current device
        self.tp_mode: TPMode = tp_mode
        self.tp = TPContext(tp_rank, tp_size, process_group)
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens
        # In data mode each rank holds the whole tower; only weights mode shards it.
        model_tp = self.tp if tp_mode == "weights" else TPContext()
        self.model: EncoderModel = load_encoder_model(self.model_dir, self.dtype, self.device, model_tp)

    @property
    def family(self) -> str:
        return self.model.family

    @property
    def hidden_size(self) -> int:
        return self.model.hidden_size

    @property
    def modalities(self) -> tuple[str, ...]:
        return self.model.modalities

    def num_embeds(self, item: EncoderInput) -> int:
        return self.model.num_embeds(item)

    @torch.inference_mode()
    def encode(self, inputs: list[EncoderInput]) -> list[torch.Tensor]:
        """One ``[num_embeds, hidden_size]`` tensor per input, in order, on this runner's device."""
        sizes = [self._checked_num_embeds(it) for it in inputs]
        budget = self.max_num_encoder_input_tokens
        steps = plan_encoder_batches(sizes, budget) if budget else [list(range(len(inputs)))]
        out: list[torch.Tensor | None] = [None] * len(inputs)
        for step in steps:
            items = [inputs[i] for i in step]
            encoded = self._encode_step(items, [sizes[i] for i in step])
            for i, t in zip(step, encoded, strict=True):
                out[i] = t
        return [t for t in out if t is not None]

    def _checked_num_embeds(self, item: EncoderInput) -> int:
        n = self.model.num_embeds(item)
        if item.num_embeds != n:
            raise ValueError(
                f"{item.modality} item {item.mm_hash}: record says {item.num_embeds} embeddings, "
                f"its tensors give {n}"
            )
        return n

    def _encode_step(self, items: list[EncoderInput], sizes: list[int]) -> list[torch.Tensor]:
        if not items:
            return []
        if self.tp_mode == "weights" or not self.tp.enabled:
            return self.model.encode(items)
        # data mode: every rank computes the same plan, runs its share, then all ranks gather all shares.
        shares = split_items_across_ranks(sizes, self.tp.size)
        mine = shares[self.tp.rank]
        local = self.model.encode([items[i] for i in mine])
        local_rows = (
            torch.cat(local)
            if local
            else torch.empty(0, self.hidden_size, device=self.device, dtype=self.dtype)
        )
        share_rows = [sum(sizes[i] for i in share) for share in shares]
        gathered = all_gather_rows(local_rows, share_rows, self.tp)
        out: list[torch.Tensor | None] = [None] * len(items)
        for share, rows in zip(shares, gathered, strict=True):
            for i, t in zip(share, rows.split([sizes[i] for i in share]), strict=True):
                out[i] = t
        return [t for t in out if t is not None]
