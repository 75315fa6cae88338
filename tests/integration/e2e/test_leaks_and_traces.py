"""A client that leaves holds nothing (no running request, KV block or cache reservation), and a
sampled request leaves one trace across the processes."""

from __future__ import annotations

import itertools
import json
import secrets
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from openai import APITimeoutError, OpenAI

from tests.integration.e2e.app_readings import (
    GENERATED,
    LONG,
    image_chat,
    llm_stats,
    metric,
    nothing_held,
    tokens_generated_since,
)
from tests.integration.e2e.common import MAX_TOKENS, PORT, VL, data_url, wait_for
from tests.media import make_image_bytes

pytestmark = pytest.mark.usefixtures("app")  # the package's one app (conftest.py)


def test_streamed_client_disconnect_aborts_the_generation(client: OpenAI, app: dict[str, Any]) -> None:
    """A client reads a few chunks of a long generation about a fresh image and hangs up: the engine
    drops the request (its KV blocks all free again) long before max_tokens, and no reservation is left."""
    before = metric(app, GENERATED, VL)
    stream = client.chat.completions.create(
        model=VL,
        messages=image_chat(make_image_bytes(98, 70, seed=611), "Go on forever."),
        max_tokens=LONG,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = 0
    for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen == 4:
            break
    mid = llm_stats()
    assert mid["num_running"] == 1 and mid["num_free_blocks"] < mid["num_total_blocks"]  # still generating
    stream.close()  # closes the HTTP connection mid-stream

    wait_for(nothing_held, 20.0, "the LLM replica to drop the abandoned stream and the reservations to go")
    generated = tokens_generated_since(client, app, before, seen)
    assert generated < LONG // 4, generated


@pytest.mark.parametrize("timeout_s", [0.05, 0.5])
def test_non_streamed_client_timeout_aborts_the_generation(
    client: OpenAI, app: dict[str, Any], timeout_s: float
) -> None:
    """A plain request about a fresh image whose client gives up (read timeout) on a long generation:
    same guarantees. After 0.05 s it is mostly gone before the first token (preprocessing or
    encoding, reservations held), after 0.5 s mid-generation."""
    before = metric(app, GENERATED, VL)
    impatient = OpenAI(
        base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", timeout=timeout_s, max_retries=0
    )
    with pytest.raises(APITimeoutError):
        impatient.chat.completions.create(
            model=VL,
            messages=image_chat(make_image_bytes(70, 98, seed=612 + int(timeout_s * 100)), "Go on forever."),
            max_tokens=LONG,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    impatient.close()

    wait_for(nothing_held, 20.0, "the LLM replica to drop the abandoned request and the reservations to go")
    generated = tokens_generated_since(client, app, before)
    assert generated < LONG // 4, generated


def _spans(trace_dir: Path) -> list[dict[str, Any]]:
    """Every span the app's processes wrote (cluster/tracing.py: one JSON line each, a file per pid)."""
    out = []
    for path in sorted(trace_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            span = json.loads(line)
            span["pid"] = path.stem
            span["trace"] = span["context"]["trace_id"].removeprefix("0x")
            for edge in ("start_time", "end_time"):  # ISO 8601 with microseconds, UTC
                span[edge] = datetime.fromisoformat(span[edge].replace("Z", "+00:00")).timestamp()
            out.append(span)
    return out


def _one(spans: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [s for s in spans if s["name"] == name]
    assert len(found) == 1, f"{len(found)} spans named {name}: {[s['name'] for s in spans]}"
    return found[0]


def _in_order(spans: list[dict[str, Any]], names: list[str]) -> None:
    """Each stage starts no earlier than the one before ended (1 ms for clocks read apart)."""
    steps = [_one(spans, n) for n in names]
    for before, after in itertools.pairwise(steps):
        assert before["end_time"] <= after["start_time"] + 1e-3, (before["name"], after["name"])
        assert before["start_time"] <= after["start_time"], (before["name"], after["name"])


def test_one_trace_per_sampled_request_across_the_processes(
    client: OpenAI, app: dict[str, Any], media_server: str
) -> None:
    """Requests whose client sent a sampled W3C traceparent each leave one trace: its spans link up
    to the client's span, a media request's cross the ingress, encoder and LLM processes with its
    stages in order, and they carry the request id and the item's mm_hash. A request without a
    traceparent leaves nothing (the e2e app samples only those: conftest.py)."""
    png = make_image_bytes(77, 56, seed=640)
    sent: dict[str, tuple[str, str]] = {}
    requests = {
        "text": "Traced?",
        "image": [{"type": "image_url", "image_url": {"url": data_url(png, "image/png")}}],
        "url": [{"type": "image_url", "image_url": {"url": f"{media_server}/traced.png"}}],
        "untraced": [{"type": "image_url", "image_url": {"url": data_url(png, "image/png")}}],
    }
    for name, content in requests.items():
        trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
        headers = {} if name == "untraced" else {"traceparent": f"00-{trace_id}-{parent}-01"}
        got = client.chat.completions.create(
            model=VL,
            messages=[{"role": "user", "content": content}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_headers=headers,
        )
        assert got.choices[0].message.content is not None
        sent[name] = (trace_id, parent)
    traced = {n: ids for n, ids in sent.items() if n != "untraced"}

    def traces() -> dict[str, list[dict[str, Any]]]:
        by_trace: dict[str, list[dict[str, Any]]] = {}
        for span in _spans(app["trace_dir"]):
            by_trace.setdefault(span["trace"], []).append(span)
        return by_trace

    def whole(spans: list[dict[str, Any]], parent: str) -> bool:
        """One tree under the client's span (FastAPI's HTTP span, if it traces, ends after the body)."""
        ids = {s["context"]["span_id"] for s in spans}
        tops = [s for s in spans if s["parent_id"] not in ids]
        return len(tops) == 1 and tops[0]["parent_id"].removeprefix("0x") == parent

    wait_for(
        lambda: all(whole(traces().get(t, []), parent) for t, parent in traced.values()),
        20.0,
        "every traced request's spans on disk, in one tree",
    )
    by_trace = traces()
    assert set(by_trace) == {t for t, _ in traced.values()}  # the untraced request recorded nothing
    for name, (trace_id, parent) in traced.items():
        spans = by_trace[trace_id]
        assert whole(spans, parent)
        root = _one(spans, "mmserve.chat")
        request_id = root["attributes"]["mmserve.request_id"]
        roles = {s["pid"]: s["resource"]["attributes"]["mmserve.role"] for s in spans}
        llm = _one(spans, "llm.request")
        assert llm["attributes"]["mmserve.request_id"] == request_id
        _in_order(spans, ["llm_queue", "prefill", "decode"])
        assert root["start_time"] <= llm["start_time"] and llm["end_time"] <= root["end_time"] + 1e-3
        if name == "text":
            assert sorted(roles.values()) == ["ingress", "llm"]
            continue
        assert sorted(set(roles.values())) == ["encoder", "ingress", "llm"] and len(roles) >= 3
        encoder = _one(spans, "encoder.prepare")
        assert encoder["attributes"]["mmserve.request_id"] == request_id
        (mm_hash,) = encoder["attributes"]["mmserve.mm_hashes"]
        assert llm["attributes"]["mmserve.mm_hashes"] == [mm_hash]
        stages = ["cache_lookup", "media_decode", "preprocess", "encoder_queue", "encode"]
        if name == "url":
            stages = ["fetch", *stages]
        encoder_side = [s for s in spans if roles[s["pid"]] == "encoder"]
        _in_order(encoder_side, [*stages])
        for stage in ("media_decode", "preprocess", "encoder_queue", "encode"):
            assert _one(encoder_side, stage)["attributes"]["mmserve.mm_hash"] == mm_hash
        prepare = _one(spans, "prepare")  # the ingress's view of it
        assert (
            prepare["start_time"] <= encoder["start_time"]
            and encoder["end_time"] <= prepare["end_time"] + 1e-3
        )
        assert _one(spans, "encode")["end_time"] <= _one(spans, "llm_queue")["start_time"] + 1e-3
