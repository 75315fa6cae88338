"""``RecentValues``: the stored form of the embeddings an encoder replica has just put, by ObjectRef id,
for the requests it prepares.

The replica that computed an item holds its value anyway until the put returns; keeping the last few
lets a prepared request carry each small item inline beside its ref (``MediaFeature.value``), as
Ray inlines a task argument under ``max_direct_call_object_size`` (100 KiB), and the LLM replica
skips the fetch: a core-worker round trip to this replica, ~0.55 CPU-ms in the fetcher and ~0.1 in
the raylet per item on this machine (README, "Benchmarks"). The ref still travels and is counted,
the object stays in the store, and a request prepared elsewhere (the ingress's hit path) fetches it.
Bounded by entries and by each value's size; the oldest go first. Pure Python: no Ray, no torch.
"""

from __future__ import annotations

from collections import OrderedDict

INLINE_VALUE_BYTES = 100 * 1024  # Ray's max_direct_call_object_size default
MAX_ENTRIES = 256  # a few encoder steps' items; at most 25 MiB held


def value_key(ref_id: str, part: int | None) -> str:
    """The key of one item's value: its object's id, and its place in it when a step's items share it."""
    return ref_id if part is None else f"{ref_id}/{part}"


class RecentValues:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = INLINE_VALUE_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        # ref id -> the stored form (``serve/encoder_steps.stored_form``): kept and handed back as it is
        self._values: OrderedDict[str, object] = OrderedDict()
        self.taken = 0  # values handed to forwarded requests

    def __len__(self) -> int:
        return len(self._values)

    def put(self, key: str, value: object, nbytes: int) -> None:
        """Keep ``value`` (the item ``key`` names: ``value_key``) if it is small enough to send inline."""
        if nbytes > self.max_bytes or self.max_entries <= 0:
            return
        self._values[key] = value
        self._values.move_to_end(key)
        while len(self._values) > self.max_entries:
            self._values.popitem(last=False)

    def get(self, key: str) -> object | None:
        value = self._values.get(key)
        if value is not None:
            self.taken += 1
        return value
