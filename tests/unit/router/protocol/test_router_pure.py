"""Router logic without Ray: message normalisation, detokenization, prefix affinity, error mapping."""

from __future__ import annotations

import base64

import pytest
from pydantic import ValidationError

from router.journey.detokenizer import IncrementalDetokenizer
from router.protocol.errors import APIError, from_exception
from router.protocol.messages import MessageLimits, normalize_messages, text_only_messages
from router.protocol.openai import ChatCompletionRequest
from router.routing.prefix_affinity import AffinityConfig, PrefixAffinityIndex, least_loaded

LIMITS = MessageLimits(
    max_messages=8, max_content_parts=8, max_media_bytes=1000, limit_mm_per_prompt={"image": 2}
)


def _req(content, **kw) -> ChatCompletionRequest:  # type: ignore[no-untyped-def]
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": content}], **kw}
    )


def test_normalize_media_parts_and_uuid() -> None:
    wav = base64.b64encode(b"RIFF....").decode()
    req = _req(
        [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "image_url", "uuid": "img-1"},
            {"type": "input_audio", "input_audio": {"data": wav, "format": "WAV"}},
        ]
    )
    chat = normalize_messages(req.messages, MessageLimits(8, 8, 1000, {"image": 2, "audio": 1}))
    kinds = [p["type"] for p in chat.messages[0]["content"]]
    assert kinds == ["text", "image", "image", "audio"]
    assert chat.media[1].uuid == "img-1" and chat.media[1].url is None
    assert chat.media[2].data == b"RIFF...." and chat.media[2].format == "wav"
    assert text_only_messages(chat)[0]["content"] == "look"


@pytest.mark.parametrize(
    ("content", "status", "fragment"),
    [
        ([{"type": "image_url", "image_url": {"url": "x"}}] * 3, 400, "limit_mm_per_prompt"),
        ([{"type": "video_url", "video_url": {"url": "x"}}], 400, "limit_mm_per_prompt['video']=0"),
        ([{"type": "image_url"}], 400, "needs a url, data or a uuid"),
        ([{"type": "input_audio", "input_audio": {"data": "!!notb64", "format": "wav"}}], 400, "base64"),
        ([{"type": "input_audio", "input_audio": {"data": "A" * 2000, "format": "wav"}}], 413, "exceeds"),
        ([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "exe"}}], 415, "format"),
        ([{"type": "text", "text": "x"}] * 9, 400, "too many content parts"),
    ],
)
def test_normalize_rejects_with_a_named_reason(content, status, fragment) -> None:  # type: ignore[no-untyped-def]
    limits = MessageLimits(8, 8, 1000, {"image": 2, "audio": 1})
    with pytest.raises(APIError) as e:
        normalize_messages(_req(content).messages, limits)
    assert e.value.status_code == status and fragment in e.value.message


def test_media_only_in_user_messages() -> None:
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "assistant", "content": [{"type": "image_url", "uuid": "u"}]}]}
    )
    with pytest.raises(APIError, match="only accepted in user"):
        normalize_messages(req.messages, LIMITS)


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "messages": []},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 17},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        {"model": "m", "messages": [{"role": "robot", "content": "x"}]},
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "pdf"}]}]},
    ],
)
def test_bad_requests_fail_validation(body) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(body)


def _byte_decoder(vocab: dict[int, bytes]):  # type: ignore[no-untyped-def]
    return lambda ids: b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")


def test_detokenizer_holds_partial_utf8_and_stops() -> None:
    # "é" split across two tokens; a stop string split across tokens.
    vocab = {0: b"caf", 1: b"\xc3", 2: b"\xa9", 3: b" EN", 4: b"D!", 5: b"more"}
    d = IncrementalDetokenizer(_byte_decoder(vocab), stop=["END"])
    out = [d.add([0]), d.add([1]), d.add([2]), d.add([3]), d.add([4])]
    assert "".join(out) == "café "
    assert out[1] == ""  # the lone lead byte is held back
    assert d.stopped
    assert d.add([5]) == ""


def test_detokenizer_without_stop_releases_everything() -> None:
    vocab = {0: b"ab", 1: b"cd"}
    d = IncrementalDetokenizer(_byte_decoder(vocab))
    assert d.add([0]) == "ab" and d.add([1]) == "cd"


def test_detokenizer_flushes_held_text_at_the_end() -> None:
    vocab = {0: b"xyE", 1: b"N"}
    d = IncrementalDetokenizer(_byte_decoder(vocab), stop=["END"])
    assert d.add([0]) == "x"
    assert d.add([1], final=True) == "yEN"
    assert not d.stopped


def test_prefix_affinity_prefers_longest_match_within_balance() -> None:
    idx = PrefixAffinityIndex(AffinityConfig(balance_abs_threshold=2, balance_rel_threshold=1.0))
    idx.record("a", [1, 2, 3])
    idx.record("b", [1, 2])
    assert idx.matched_blocks([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 2, "c": 0}
    assert idx.choose([1, 2, 3, 4], {"a": 0, "b": 0, "c": 0})[0] == "a"
    # "a" is too busy compared with the least-loaded replica: the next best match wins.
    assert idx.choose([1, 2, 3, 4], {"a": 10, "b": 1, "c": 0})[0] == "b"
    # no match anywhere: least loaded first.
    assert idx.choose([9], {"a": 3, "b": 1, "c": 2}) == ["b", "c", "a"]
    # a hash not at the start does not count as a prefix match.
    idx.record("c", [2, 3])
    assert idx.matched_blocks([1, 2, 3], ["c"]) == {"c": 0}


def test_equal_loads_are_broken_at_random_so_a_burst_spreads() -> None:
    """A burst of distinct requests routed before any is counted sees every replica at the same
    load: in a fixed order they would all go to one replica."""
    import random

    idx = PrefixAffinityIndex(rng=random.Random(0))
    firsts = [idx.choose([i], {"a": 0, "b": 0, "c": 0})[0] for i in range(300)]
    assert min(firsts.count(r) for r in "abc") > 60  # ~100 each
    idx.record("b", [7])  # a match still wins over the tie, and load still orders the rest
    assert all(idx.choose([7], {"a": 0, "b": 0, "c": 0})[0] == "b" for _ in range(20))
    assert all(idx.choose([8], {"a": 1, "b": 0, "c": 2}) == ["b", "a", "c"] for _ in range(20))
    rng = random.Random(1)
    assert {least_loaded({"a": 0, "b": 0}, rng)[0] for _ in range(50)} == {"a", "b"}
    assert all(least_loaded({"a": 1, "b": 0}, rng) == ["b", "a"] for _ in range(20))


def test_prefix_affinity_lru_bound_and_replica_removal() -> None:
    idx = PrefixAffinityIndex(AffinityConfig(max_entries=3))
    idx.record("a", [1, 2, 3])
    idx.record("b", [4])
    assert len(idx) == 3
    assert idx.matched_blocks([1], ["a"]) == {"a": 0}  # the oldest entry was evicted
    idx.remove_replica("b")
    assert idx.matched_blocks([4], ["b"]) == {"b": 0}


def test_error_mapping_unwraps_causes() -> None:
    class MediaError(Exception):
        status_code = 413
        code = "media_too_large"

    class RequestRejected(ValueError):
        code = "prompt_too_long"

    class Wrapper(Exception):
        def __init__(self, cause: BaseException) -> None:
            super().__init__("wrapped")
            self.cause = cause

    err = from_exception(Wrapper(MediaError("image 0: too big")))
    assert err is not None and err.status_code == 413 and err.code == "media_too_large"
    err = from_exception(RequestRejected("prompt has 5000 tokens"))
    assert err is not None and err.status_code == 400
    assert from_exception(RuntimeError("boom")) is None


def test_service_unavailable_errors_map_to_503_with_retry_after() -> None:
    from encoder_service.preprocess.errors import EncoderCacheBusy

    class Wrapper(Exception):
        def __init__(self, cause: BaseException) -> None:
            super().__init__("wrapped")
            self.cause = cause

    err = from_exception(Wrapper(EncoderCacheBusy("encoder cache: every entry is pinned")))
    assert err is not None and (err.status_code, err.code) == (503, "encoder_cache_busy")
    assert err.headers() == {"Retry-After": "1"}


def test_seed_and_top_k_outside_what_the_wire_carries_are_refused() -> None:
    from pydantic import ValidationError

    for bad in ({"seed": 1 << 64}, {"seed": -(1 << 63) - 1}, {"top_k": 1 << 64}):
        with pytest.raises(ValidationError):
            _req("hi", **bad)
    assert _req("hi", seed=(1 << 63) - 1, top_k=50).seed == (1 << 63) - 1
