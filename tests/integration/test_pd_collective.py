"""E/P/D with ``llm.kv_transfer: collective`` over HTTP: each request's KV moves from the prefill replica
to the decode replica on the gloo pair group they form on their first hand-off (llm_service/serve/
kv_pair.py), straight between the paged caches; the link carries only the control. One small app:
tiny Qwen2-VL (full-attention blocks), Gemma 3 (a sliding-window layer's own blocks) and Qwen3.5 (the
hybrid's linear-attention state and snapshot on the group too). Answers equal transformers' greedy
``generate`` for text, one and two images and a three-turn chat (whose later turns Qwen2-VL's decode
replica finds in its own prefix cache: the received blocks are registered under the same chained
hashes); every byte crossed on the group, one pair formed per model and kept; every pin ended by its
transfer, nothing left running."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.hf_oracle import hf_generate
from tests.integration.local_app import local_app
from tests.integration.test_pd_families import MAX_TOKENS, Family, _chat, _hf, _image, _model_config, _stats

COLLECTIVE = (("kv_transfer", "collective"),)
FAMILIES = [
    Family("qwen2-vl", decode_hit=True, llm=COLLECTIVE),
    Family("gemma3", max_num_batched_tokens=24, llm=COLLECTIVE),
    Family("qwen3.5", full_hit=False, llm=(("snapshot_interval_blocks", 4), *COLLECTIVE)),
]


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    cache_dir = tmp_path_factory.mktemp("models")
    config = {"models": [_model_config(f) for f in FAMILIES], "models_cache_dir": str(cache_dir)}
    with local_app(config, num_cpus=4) as client:
        yield {"client": client, "cache_dir": Path(cache_dir), "families": FAMILIES}


def test_text_and_images_equal_hf_with_every_byte_on_the_pair_group(app: dict[str, Any]) -> None:
    client = app["client"]
    for f in app["families"]:
        before = _stats("decode", f)
        text = "hello there, tell me more"
        served, _, _ = _chat(client, f, [{"role": "user", "content": text}])
        assert served == _hf(app, f, [{"type": "text", "text": text}]), f.tiny
        parts, images = zip(*(_image(w, h, s) for w, h, s in [(96, 64, 31), (56, 120, 32)]), strict=True)
        for n in (1, 2):
            content = [*parts[:n], {"type": "text", "text": "Compare."}]
            served, _, _ = _chat(client, f, [{"role": "user", "content": content}])
            hf_content = [*[{"type": "image"}] * n, {"type": "text", "text": "Compare."}]
            assert served == _hf(app, f, hf_content, images=list(images[:n])), (f.tiny, n)
        after = _stats("decode", f)
        assert after["kv_imports"] == before["kv_imports"] + 3, f.tiny
        moved = after["kv_bytes_pulled"] - before["kv_bytes_pulled"]
        assert moved > 0 and after["kv_bytes_collective"] - before["kv_bytes_collective"] == moved, f.tiny
        assert after["kv_pairs"] == after["kv_pairs_formed"] == 1, f.tiny  # formed once, kept
        assert after["skipped_embedding_fetches"] == 0, f.tiny


def test_three_turn_chat_equals_hf_and_hits_the_decode_replicas_cache(app: dict[str, Any]) -> None:
    for f in app["families"]:
        decode_hits = _stats("decode", f)["kv_blocks_hit"]
        part, img = _image(96, 64, 70)
        served: list[dict[str, Any]] = []
        hf_msgs: list[dict[str, Any]] = []
        for turn, question in enumerate(["What is this?", "And its colours?", "Anything else?"]):
            text = {"type": "text", "text": question}
            served.append({"role": "user", "content": [part, text] if turn == 0 else question})
            hf_msgs.append({"role": "user", "content": [{"type": "image"}, text] if turn == 0 else question})
            answer, _, cached = _chat(app["client"], f, served)
            assert answer == hf_generate(app["cache_dir"] / f.model, hf_msgs, MAX_TOKENS, images=[img]), (
                f.tiny,
                turn,
            )
            assert turn == 0 or cached > 0, (f.tiny, turn)
            served.append({"role": "assistant", "content": answer})
            hf_msgs.append({"role": "assistant", "content": answer})
        if f.decode_hit:
            assert _stats("decode", f)["kv_blocks_hit"] > decode_hits, f.tiny


def test_every_pin_ended_by_its_transfer(app: dict[str, Any]) -> None:
    for f in app["families"]:
        p, d = _stats("prefill", f), _stats("decode", f)
        assert p["kv_handoffs"] == p["kv_pulls"] == d["kv_imports"] > 0, f.tiny
        assert p["kv_expired"] == 0 and p["kv_pins_held"] == 0 and d["kv_failed_imports"] == 0, f.tiny
        assert p["kv_pairs"] == d["kv_pairs"] == 1 and p["kv_pairs_dropped"] == d["kv_pairs_dropped"] == 0
        assert p["num_running"] == p["num_waiting"] == d["num_running"] == d["num_waiting"] == 0, f.tiny
        n = d["kv_imports"]
        print(  # what a hand-off cost on the group (shown with -s)
            f"\nE/P/D collective {f.model}: {n:.0f} hand-offs, {d['kv_bytes_collective'] / n / 2**20:.4f} MiB "
            f"per request, {1000 * d['kv_import_cpu_s'] / n:.2f} CPU-ms receiving, "
            f"{1000 * p['kv_export_cpu_s'] / n:.2f} CPU-ms sending per request"
        )
