"""Placeholder expansion: each media placeholder token of a templated prompt becomes its item's run(s)
of embedding positions (``family.expand_placeholder``), and each run one ``MediaFeature``.

Pure (no torch, no Ray): the family adapter and the preprocessor's items are passed in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from encoder_service.preprocess.errors import InvalidMediaInput
from encoder_service.types import EncoderInput, MediaRef
from mmcore.feature import ItemFacts, MediaFeature, Modality, PlaceholderRange


class Placed(Protocol):
    """One media item as the preprocessor holds it once its length and grid are known."""

    index: int
    ref: MediaRef
    mm_hash: str
    facts: ItemFacts | None  # known once processed or found in the cache
    encoder_input: EncoderInput | None

    @property
    def metadata(self) -> Mapping[str, object] | None: ...  # read here only: any mapping will do


class Family(Protocol):
    @property
    def modalities(self) -> tuple[Modality, ...]: ...

    @property
    def placeholder_token_ids(self) -> dict[Modality, int]: ...

    def expand_placeholder(
        self, modality: Modality, token_id: int, num_embeds: int, frame_times: list[float] | None
    ) -> list[int]: ...


def expand_placeholders(
    family: Family, ids: list[int], items: Sequence[Placed]
) -> tuple[list[int], list[MediaFeature]]:
    """The prompt ids with every placeholder expanded, and one record per placeholder run, in item
    order (``items`` in prompt order)."""
    queues = {m: [it for it in items if it.ref.modality == m] for m in family.modalities}
    by_token = {tid: m for m, tid in family.placeholder_token_ids.items()}
    out_ids: list[int] = []
    runs: dict[int, list[PlaceholderRange]] = {}
    for tid in ids:
        modality = by_token.get(tid)
        if modality is None:
            out_ids.append(tid)
            continue
        if not queues[modality]:
            raise InvalidMediaInput(  # transformers' processors refuse it too
                f"the prompt has more {modality} placeholders than {modality} items: the message text "
                f"spells the model's {modality} placeholder token (id {tid})"
            )
        it = queues[modality].pop(0)
        facts = _facts(it)
        expansion = family.expand_placeholder(modality, tid, facts.num_embeds, facts.frame_times)
        runs[it.index] = _placeholder_runs(expansion, tid, len(out_ids))
        out_ids.extend(expansion)
    if any(queues.values()) or len(runs) != len(items):
        raise InvalidMediaInput(
            "the chat template dropped a media placeholder (text contains special tokens?)"
        )
    mm_items = [mm for it in items for mm in _items_of(it, runs[it.index])]
    return out_ids, mm_items


def _placeholder_runs(expansion: list[int], token_id: int, start: int) -> list[PlaceholderRange]:
    """The maximal runs of ``token_id`` in ``expansion``, placed at prompt offset ``start``."""
    out: list[PlaceholderRange] = []
    for i, tid in enumerate(expansion):
        if tid != token_id:
            continue
        if out and out[-1].end == start + i:
            out[-1] = PlaceholderRange(out[-1].offset, out[-1].length + 1)
        else:
            out.append(PlaceholderRange(start + i, 1))
    return out


def _items_of(it: Placed, runs: list[PlaceholderRange]) -> list[MediaFeature]:
    """One record per placeholder run. An item of several runs (a Qwen3-VL video: one per temporal
    patch) gives each run its rows of the item's embeddings and its own ``(1, h, w)`` grid; they
    share the mm_hash, and only the first carries the encoder input (the item is encoded once)."""
    facts = _facts(it)
    grid = facts.grid_thw
    if len(runs) > 1 and (
        grid is None or grid[0] % len(runs) or sum(r.length for r in runs) != facts.num_embeds
    ):
        raise RuntimeError(
            f"{it.ref.modality} {it.index}: {len(runs)} placeholder runs do not split its grid"
        )
    if len(runs) > 1 and grid is not None:
        grid = (grid[0] // len(runs), grid[1], grid[2])
    out, row = [], 0
    for i, run in enumerate(runs):
        out.append(
            MediaFeature(
                index=it.index,
                modality=it.ref.modality,
                mm_hash=it.mm_hash,
                offset=run.offset,
                length=run.length,
                grid_thw=grid,
                second_per_grid_ts=facts.second_per_grid_ts,
                rows=(row, row + run.length) if len(runs) > 1 else None,
                metadata=dict(it.metadata or {}),
                data=it.encoder_input if i == 0 else None,
            )
        )
        row += run.length
    return out


def _facts(it: Placed) -> ItemFacts:
    if it.facts is None:  # every item is processed or found before its placeholder expands: a bug
        raise RuntimeError(f"{it.ref.modality} {it.index} has no facts (neither processed nor cached)")
    return it.facts
