"""Writes the seed corpus, ``corpus/<target>/`` (``python -m cluster.bench.fuzz.seeds``; the bytes are
committed, so run it again only to change them). A handful of small valid and near-valid inputs each;
every file under 20 KB. The media targets' seeds are in media_seeds.py, the HTTP bodies' in
body_seeds.py; the data URL, link frame and wire record seeds here."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path

import msgpack

from cluster.bench.fuzz.body_seeds import chat_body_seeds, completions_body_seeds, responses_body_seeds
from cluster.bench.fuzz.media_seeds import _png, audio_seeds, image_seeds, video_seeds

HERE = Path(__file__).resolve().parent
MAX_SEED_BYTES = 20 * 1024


def data_url_seeds() -> dict[str, bytes]:
    png = base64.b64encode(_png(4, 4)).decode()
    return {
        "png_b64.bin": b"\x00data:image/png;base64," + png.encode(),
        "percent.bin": b"\x01data:video/mp4,%00%01abc%ff",
        "plain_text.bin": b"\x02data:,hello%20world",
        "no_comma.bin": b"\x00data:image/png;base64",
        "bad_b64.bin": b"\x00data:;base64,AAA=A===",
        "too_large.bin": b"\x02data:audio/wav;base64," + b"A" * 3000,
        "not_data.bin": b"\x00https://example.com/a.png",
        "surrogate.bin": b"\x00DATA:image/png;charset=\xff;base64,\xed\xa0\x80",
    }


def link_frames_seeds() -> dict[str, bytes]:
    frames = {
        "call.bin": [7, "prepare", 5000],
        "cancel.bin": [7, None],
        "failed.bin": [9, 2, "busy", "1024 calls in flight"],
        "ok.bin": [9, 0],
        "more.bin": [9, 3],
        "raised.bin": [9, 1],
        "short.bin": [1],
        "not_int.bin": ["x", 0],
    }
    out = {name: bytes(msgpack.packb(f)) for name, f in frames.items()}
    out["truncated.bin"] = out["failed.bin"][:-3]
    return out


def wire_records_seeds() -> dict[str, bytes]:
    from cluster.bench.fuzz.wire_records import KINDS
    from encoder_service.types import EmbeddingMeta
    from mmcore.wire import WIRE_VERSION, pack

    meta = EmbeddingMeta("h" * 16, "video", 12, 64, "bfloat16", (2, 4, 6), 0.5, [0.0, 1.0], 4, 1)
    out = {"embedding_meta.bin": bytes([0]) + meta.to_msgpack()}
    out["embedding_meta_missing.bin"] = bytes([0]) + pack(
        "EmbeddingMeta", {"mm_hash": "a", "modality": "image"}
    )
    out["embedding_meta_old.bin"] = bytes([0]) + bytes(
        msgpack.packb({"v": WIRE_VERSION - 1, "kind": "EmbeddingMeta"})
    )
    for i, kind in enumerate(KINDS[1:], start=1):
        out[f"{kind}.bin"] = bytes([i]) + pack(kind, {"request_id": "r", "items": [], "inputs": []})
    out["wrong_kind.bin"] = bytes([2]) + pack("EncodeBatch", {})
    return out


SEEDS: dict[str, Callable[[], dict[str, bytes]]] = {
    "chat_body": chat_body_seeds,
    "completions_body": completions_body_seeds,
    "responses_body": responses_body_seeds,
    "data_url": data_url_seeds,
    "image": image_seeds,
    "video": video_seeds,
    "audio": audio_seeds,
    "link_frames": link_frames_seeds,
    "wire_records": wire_records_seeds,
}


def write_all() -> None:
    for target, make in SEEDS.items():
        folder = HERE / "corpus" / target
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.iterdir():
            old.unlink()
        for name, data in make().items():
            assert len(data) < MAX_SEED_BYTES, (target, name, len(data))
            (folder / name).write_bytes(data)
        print(
            f"{target}: {len(list(folder.iterdir()))} seeds, {sum(f.stat().st_size for f in folder.iterdir())} bytes"
        )


if __name__ == "__main__":
    write_all()
