"""The engine's waiting queue is bounded (requests and prompt tokens); past it, 503 at once."""

from __future__ import annotations

import pickle

import pytest

from llm_service.scheduler import WaitingBound, WaitingQueueFull
from router.protocol.errors import from_exception


def test_bound_by_requests_and_by_tokens() -> None:
    b = WaitingBound(max_requests=3, max_tokens=100)
    b.check(2, 50, 50)
    with pytest.raises(WaitingQueueFull, match="max_waiting_requests=3"):
        b.check(3, 0, 1)
    with pytest.raises(WaitingQueueFull, match="max_waiting_tokens=100"):
        b.check(1, 60, 41)


def test_an_empty_queue_takes_any_request() -> None:
    WaitingBound(max_requests=1, max_tokens=10).check(0, 0, 10_000)


def test_refusal_is_a_503_with_retry_after_across_pickling() -> None:
    err = pickle.loads(pickle.dumps(WaitingQueueFull("full")))
    api = from_exception(err)
    assert api is not None and api.status_code == 503 and api.code == "overloaded"
    assert api.headers() == {"Retry-After": "1"}
