"""A failed request's log line carries what replays it: item hashes, placeholders, parsed metadata."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from encoder_service.types import MediaRef
from router.http.replay_log import failure_record, log_failure, media_summary
from router.protocol.errors import APIError
from tests.unit.router.journey.orchestrator_world import H1, H2, World, _build, _chat


def test_media_summary_names_sources_without_bytes_or_queries() -> None:
    media = [
        MediaRef("image", data=b"\x89PNG secret bytes"),
        MediaRef("image", url="data:image/png;base64,c2VjcmV0"),
        MediaRef("video", url="https://cdn.test/v.mp4?token=secret"),
        MediaRef("audio", uuid="clip-7"),
    ]
    assert media_summary(media) == [
        {"modality": "image", "source": "bytes", "uuid": None},
        {"modality": "image", "source": "data_url", "uuid": None},
        {"modality": "video", "source": "https://cdn.test/v.mp4", "uuid": None},
        {"modality": "audio", "source": "uuid", "uuid": "clip-7"},
    ]
    assert "secret" not in json.dumps(media_summary(media))
    tricky = [
        MediaRef("image", url=" DATA:image/png;base64,c2VjcmV0"),  # fetched too: schemes are case-blind
        MediaRef("image", url="https://alice:secret@cdn.test:8443/a.png#secret"),
    ]
    assert [m["source"] for m in media_summary(tricky)] == ["data_url", "https://cdn.test:8443/a.png"]


def test_error_text_loses_url_credentials_queries_and_data() -> None:
    err = ValueError(
        "image 0: GET 'https://u:secret@s3.test/b/k.png?X-Amz-Signature=secret' answered 403; "
        "image 1: data:image/png;base64,c2VjcmV0 is not valid base64"
    )
    record = failure_record("r", 403, "url_not_allowed", err, [], None)
    assert "secret" not in record["error"] and "c2VjcmV0" not in record["error"]
    assert "https://s3.test/b/k.png" in record["error"] and "data_url" in record["error"]


def test_orchestrator_keeps_the_preprocessed_facts_of_a_failed_request() -> None:
    orch, _ = _build(World())
    orch.max_model_len = 8  # the fake prompt with two images is 1 + 2*4 + 1 = 10 tokens

    with pytest.raises(APIError, match="max_model_len is 8"):
        asyncio.run(orch.prepare("r1", _chat(H1, H2)))
    facts = orch.replay("r1")
    assert facts is not None and facts["num_prompt_tokens"] == 10
    assert [(i["index"], i["mm_hash"], i["offset"], i["length"]) for i in facts["items"]] == [
        (0, H1, 1, 4),
        (1, H2, 5, 4),
    ]
    record = failure_record("r1", 400, "prompt_too_long", ValueError("too long"), _chat(H1, H2).media, facts)
    assert record["preprocessed"]["items"][1]["mm_hash"] == H2 and record["code"] == "prompt_too_long"
    orch.forget("r1")
    assert orch.replay("r1") is None


def test_client_errors_log_at_info_server_errors_at_warning_with_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("test.replay")
    with caplog.at_level(logging.INFO, logger="test.replay"):
        try:
            raise RuntimeError("engine died")
        except RuntimeError as e:
            log_failure(logger, failure_record("r2", 500, "internal_error", e, [], None), e)
        log_failure(
            logger,
            failure_record("r3", 415, "unsupported_format", ValueError("x"), [], None),
            ValueError("x"),
        )
    warn, info = caplog.records
    assert warn.levelno == logging.WARNING and warn.exc_info is not None
    assert json.loads(warn.getMessage())["request_id"] == "r2"
    assert info.levelno == logging.INFO and json.loads(info.getMessage())["status"] == 415
