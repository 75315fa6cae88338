"""A chaos scenario's books: each request's verdict from how it ended, and the row they make."""

from __future__ import annotations

import httpx
import openai
import pytest

from cluster.bench.chaos_outcomes import CODED, LOST, OK, UNCODED, Outcome, classify, report, row


def _status_error(status: int, body: object) -> openai.APIStatusError:
    request = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    response = httpx.Response(status, request=request, json=body)
    return openai.APIStatusError("failed", response=response, body=body)


def test_a_coded_json_error_a_coded_sse_event_and_a_cut_connection() -> None:
    body = {"message": "the LLM replica died", "type": "service_unavailable", "code": "llm_replica_lost"}
    assert classify(_status_error(503, body)) == (CODED, "llm_replica_lost")
    # An SSE error event in a stream: the openai client raises APIError with the event's body.
    request = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    event = openai.APIError("the encoder replica died", request, body={"code": "replica_lost"})
    assert classify(event) == (CODED, "replica_lost")
    assert classify(_status_error(500, {"message": "boom"})) == (UNCODED, None)
    assert classify(openai.APIConnectionError(request=request)) == (UNCODED, None)
    assert classify(None) == (OK, None)
    assert classify(TimeoutError(), timed_out=True) == (LOST, None)


def test_report_counts_each_verdict_and_times_from_the_fault() -> None:
    outcomes = [
        Outcome("image", 0.0, 1.0, OK),
        Outcome("image", 0.5, 3.0, CODED, "llm_replica_lost"),  # open at the fault (t=2)
        Outcome("image", 1.5, 9.0, LOST, detail="no answer within 5 s"),  # open at the fault
        Outcome("image", 2.5, 6.0, OK),  # the first success sent after the fault
        Outcome("image", 3.0, 4.0, UNCODED, detail="APIConnectionError: Connection error."),
    ]
    r = report("node-loss", outcomes, fault_at=2.0, full_capacity_s=12.5, leaks={"kv_blocks_held": 0})
    assert r.counts == {OK: 2, CODED: 1, UNCODED: 1, LOST: 1}
    assert r.codes == {"llm_replica_lost": 1}
    assert r.in_flight_at_fault == 2
    assert r.first_ok_after_s == pytest.approx(4.0)
    assert r.leak_count == 0
    assert row(r)[:6] == ["node-loss", "5", "2", "1", "1", "1"]
    assert row(r)[-2:] == ["12.5", "0"]
    assert any("Connection error" in n for n in r.notes)


def test_a_leak_is_named_in_the_row() -> None:
    r = report("scale-up-kill", [], None, None, leaks={"reserved": 2, "named_actors": []})
    assert r.leak_count == 1 and row(r)[-1] == "reserved=2"
    with pytest.raises(ValueError, match="verdict"):
        Outcome("image", 0.0, 1.0, "gone")
