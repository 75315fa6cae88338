"""One log line per failed request, carrying what is needed to replay it (no media bytes, no tensors).

    {"event": "request_failed", "request_id", "status", "code", "error",
     "media": [{"modality", "source", "uuid"}],                      # what the client sent
     "preprocessed": {"num_prompt_tokens", "processor_kwargs",       # once preprocessing succeeded:
                      "items": [{"index", "mm_hash", "modality",      #   each item's hash, placement
                                 "offset", "length", "grid_thw",      #   and parsed metadata (size,
                                 ...metadata}]}}                      #   frames, seconds)

Client errors (4xx) log at INFO, the server's own at WARNING with the traceback.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from encoder_service.types import MediaRef


def media_summary(media: list[MediaRef]) -> list[dict[str, Any]]:
    """Where each item came from, without its bytes: a URL without its query string, never a data URL."""
    out = []
    for m in media:
        if m.data is not None:
            source = "bytes"
        elif m.url is None:
            source = "uuid"
        elif m.url.startswith("data:"):
            source = "data_url"
        else:
            source = m.url.split("?", 1)[0][:200]
        out.append({"modality": m.modality, "source": source, "uuid": m.uuid})
    return out


def failure_record(
    request_id: str,
    status: int,
    code: str,
    error: BaseException,
    media: list[MediaRef],
    preprocessed: dict[str, Any] | None,
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "event": "request_failed",
        "request_id": request_id,
        "status": status,
        "code": code,
        "error": f"{type(error).__name__}: {error}"[:2000],
        "media": media_summary(media),
    }
    if preprocessed is not None:
        record["preprocessed"] = preprocessed
    return record


def log_failure(logger: logging.Logger, record: dict[str, Any], error: BaseException) -> None:
    line = json.dumps(record, default=str, sort_keys=True)
    if record["status"] < 500:
        logger.info("%s", line)
    else:
        logger.warning("%s", line, exc_info=error)
