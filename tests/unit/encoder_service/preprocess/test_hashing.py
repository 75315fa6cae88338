"""mm_hash: deterministic across processes, sensitive to every input that changes the encoding."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from encoder_service.preprocess.hashing import compute_mm_hash, uuid_alias_key
from tests.media import make_image_bytes

KW = {"size": {"shortest_edge": 3136, "longest_edge": 802816}, "patch_size": 14, "merge_size": 2}


def test_same_hash_in_another_process():
    data = make_image_bytes(32, 24)
    code = (
        "import sys; from encoder_service.preprocess.hashing import compute_mm_hash; from tests.media import make_image_bytes;"
        f"print(compute_mm_hash('m', 'image', data=make_image_bytes(32, 24), processor_kwargs={KW!r}))"
    )
    root = Path(__file__).resolve().parents[4]
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"},
    )
    assert out.stdout.strip() == compute_mm_hash(
        "m", "image", data=data, processor_kwargs=dict(reversed(KW.items()))
    )


def test_every_input_changes_the_hash():
    data = make_image_bytes(32, 24)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    base = compute_mm_hash("m", "image", data=data, processor_kwargs=KW)
    variants = [
        compute_mm_hash("m", "image", data=bytes(flipped), processor_kwargs=KW),
        compute_mm_hash("m", "image", data=data, processor_kwargs={**KW, "merge_size": 1}),
        compute_mm_hash("m", "image", data=data, processor_kwargs={**KW, "size": {"shortest_edge": 3136}}),
        compute_mm_hash("m2", "image", data=data, processor_kwargs=KW),
        compute_mm_hash("m", "video", data=data, processor_kwargs=KW),
        compute_mm_hash("m", "image", data=data),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_uuid_names_are_per_tenant_and_never_an_mm_hash():
    """A uuid is a name in its tenant's namespace, not content: its key differs per tenant, per
    model and modality, and from any content hash (the bytes of the uuid included)."""
    keys = [
        uuid_alias_key("m", "image", None, "cat"),
        uuid_alias_key("m", "image", "a", "cat"),
        uuid_alias_key("m", "image", "b", "cat"),
        uuid_alias_key("m", "image", "a", "dog"),
        uuid_alias_key("m", "video", "a", "cat"),
        uuid_alias_key("m2", "image", "a", "cat"),
        uuid_alias_key("m", "image", "", "cat"),  # an empty tenant name is not the open server's
        compute_mm_hash("m", "image", data=b"cat"),
    ]
    assert len(set(keys)) == len(keys)
    assert uuid_alias_key("m", "image", "a", "cat") == uuid_alias_key("m", "image", "a", "cat")
