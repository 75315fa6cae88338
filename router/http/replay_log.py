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
import re
from collections.abc import Mapping
from typing import NotRequired, TypedDict
from urllib.parse import urlsplit

from encoder_service.types import MediaRef


class MediaSource(TypedDict):
    modality: str
    source: str  # "bytes", "uuid", or the redacted URL
    uuid: str | None


class FailureRecord(TypedDict):
    event: str
    request_id: str
    status: int
    code: str
    error: str
    media: list[MediaSource]
    preprocessed: NotRequired[Mapping[str, object]]  # Orchestrator.replay's facts


_URL_IN_TEXT = re.compile(r"(?i)\b(?:https?|file)://[^\s'\"<>]+")
_DATA_URL_IN_TEXT = re.compile(r"(?i)\bdata:[^\s'\"<>]*")


def redact_url(url: str) -> str:
    """Scheme, host, port and path only: no credentials, query string or fragment; never a data URL."""
    u = url.strip()
    if u[:5].lower() == "data:":
        return "data_url"
    try:
        parts = urlsplit(u)
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "unparseable_url"
    return f"{parts.scheme.lower()}://{parts.hostname or ''}{port}{parts.path}"[:200]


def redact_text(text: str) -> str:
    """An error message with every URL in it redacted (fetch errors quote the URL they failed on)."""
    text = _DATA_URL_IN_TEXT.sub("data_url", text)
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)


def media_summary(media: list[MediaRef]) -> list[MediaSource]:
    """Where each item came from, without its bytes (see ``redact_url``)."""
    out: list[MediaSource] = []
    for m in media:
        if m.data is not None:
            source = "bytes"
        elif m.url is None:
            source = "uuid"
        else:
            source = redact_url(m.url)
        out.append({"modality": m.modality, "source": source, "uuid": m.uuid})
    return out


def failure_record(
    request_id: str,
    status: int,
    code: str,
    error: BaseException,
    media: list[MediaRef],
    preprocessed: Mapping[str, object] | None,
) -> FailureRecord:
    record: FailureRecord = {
        "event": "request_failed",
        "request_id": request_id,
        "status": status,
        "code": code,
        "error": redact_text(f"{type(error).__name__}: {error}")[:2000],
        "media": media_summary(media),
    }
    if preprocessed is not None:
        record["preprocessed"] = preprocessed
    return record


def log_failure(logger: logging.Logger, record: FailureRecord, error: BaseException) -> None:
    line = json.dumps(record, default=str, sort_keys=True)
    if record["status"] < 500:
        logger.info("%s", line)
    else:
        logger.warning("%s", line, exc_info=error)
