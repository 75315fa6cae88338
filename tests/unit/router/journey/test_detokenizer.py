"""IncrementalDetokenizer against the full ``tokenizer.decode`` of the final ids, with the project's
real byte-level BPE tokenizer: random ids (special tokens, lone bytes that split UTF-8 characters,
invalid bytes), random add() chunking, stop strings; and a decode-work count that grows linearly."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.journey.detokenizer import REPLACEMENT, IncrementalDetokenizer

Decode = Callable[[Sequence[int]], str]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are spelled in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


@pytest.fixture(scope="module")
def tok(tiny_vl_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_vl_dir)


@pytest.fixture(scope="module")
def decode(tok: Any) -> Decode:
    # What the router's Orchestrator.decode does.
    return lambda ids: str(tok.decode(list(ids), skip_special_tokens=True))


@pytest.fixture(scope="module")
def byte_ids(tok: Any) -> dict[int, int]:
    ids = {b: tok.convert_tokens_to_ids(ch) for b, ch in bytes_to_unicode().items()}
    assert len(set(ids.values())) == 256 and tok.unk_token_id not in ids.values()
    return ids


def as_byte_tokens(text: str, byte_ids: dict[int, int]) -> list[int]:
    """One token per UTF-8 byte: every multi-byte character is split across tokens."""
    return [byte_ids[b] for b in text.encode()]


def boundaries(ids: list[int], cuts: list[int]) -> list[int]:
    return [*sorted({c for c in cuts if 0 < c < len(ids)}), len(ids)]


def stream(decode: Decode, ids: list[int], cuts: list[int], stop: Sequence[str] = ()) -> tuple[str, bool]:
    d = IncrementalDetokenizer(decode, stop=stop)
    bounds = boundaries(ids, cuts)
    out, start = [], 0
    for end in bounds:
        out.append(d.add(ids[start:end], final=end == len(ids)))
        start = end
        if d.stopped:
            break
    return "".join(out), d.stopped


def expected(decode: Decode, ids: list[int], cuts: list[int], stop: Sequence[str]) -> tuple[str, bool]:
    """The quadratic oracle: decode everything after each add; stop at the first add whose stable
    text (trailing U+FFFD of an unfinished character dropped, unless final) holds a stop string."""
    bounds = boundaries(ids, cuts)
    for end in bounds:
        text = decode(ids[:end])
        if end < len(ids):
            text = text.rstrip(REPLACEMENT)
        hits = [i for s in stop if (i := text.find(s)) != -1]
        if hits:
            return text[: min(hits)], True
    return decode(ids), False


UNICODE = st.text(
    alphabet=st.characters(codec="utf-8", categories=("L", "N", "P", "S", "Zs", "So")), max_size=12
)


@st.composite
def id_sequences(draw: st.DrawFn, vocab: int, byte_ids: dict[int, int], tok: Any) -> list[int]:
    parts: list[int] = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["random", "bytes", "encoded", "invalid"]))
        if kind == "random":  # anything: special tokens, merges, lone bytes
            parts += draw(st.lists(st.integers(0, vocab - 1), max_size=12))
        elif kind == "bytes":
            parts += as_byte_tokens(draw(UNICODE), byte_ids)
        elif kind == "encoded":
            parts += tok.encode(draw(UNICODE), add_special_tokens=False)
        else:  # bytes that never form a character: lone lead and continuation bytes
            parts += [byte_ids[b] for b in draw(st.lists(st.sampled_from([0xE4, 0xF0, 0x80, 0xBF, 0xFF])))]
    return parts


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_deltas_concatenate_to_the_full_decode(tok, decode, byte_ids, data) -> None:
    ids = data.draw(id_sequences(len(tok), byte_ids, tok))
    cuts = data.draw(st.lists(st.integers(0, max(len(ids), 1)), max_size=len(ids)))
    assert stream(decode, ids, cuts) == (decode(ids), False)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_stop_strings_cut_where_the_full_decode_does(tok, decode, byte_ids, data) -> None:
    ids = data.draw(id_sequences(len(tok), byte_ids, tok))
    cuts = data.draw(st.lists(st.integers(0, max(len(ids), 1)), max_size=len(ids)))
    full = decode(ids)
    stop = []
    for _ in range(data.draw(st.integers(1, 4))):
        if full and data.draw(st.booleans()):
            a = data.draw(st.integers(0, len(full) - 1))
            stop.append(full[a : a + data.draw(st.integers(1, 6))])
        else:
            stop.append(data.draw(st.text(min_size=1, max_size=4)))
    assert stream(decode, ids, cuts, stop) == expected(decode, ids, cuts, stop)


def test_split_characters_are_held_then_released_whole(decode, byte_ids) -> None:
    ids = as_byte_tokens("a中😀b", byte_ids)  # 1 + 3 + 4 + 1 bytes
    d = IncrementalDetokenizer(decode)
    deltas = [d.add([i]) for i in ids]
    assert deltas == ["a", "", "", "中", "", "", "", "😀", "b"]


def test_invalid_bytes_come_out_as_replacement_characters(decode, byte_ids) -> None:
    ids = [byte_ids[0xE4], byte_ids[0x41], byte_ids[0xFF]]  # lead byte then "A"; a lone 0xFF
    d = IncrementalDetokenizer(decode)
    assert [d.add([ids[0]]), d.add([ids[1]]), d.add([ids[2]], final=True)] == ["", "\ufffdA", "\ufffd"]


class CountingDecode:
    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.calls = 0
        self.ids = 0  # total ids passed to decode: the detokenizer's work

    def __call__(self, ids: Sequence[int]) -> str:
        self.calls += 1
        self.ids += len(ids)
        return self.decode(ids)


def decode_work(decode: Decode, ids: list[int]) -> CountingDecode:
    counting = CountingDecode(decode)
    d = IncrementalDetokenizer(counting, stop=["never appears \x00"])
    text = "".join(d.add([t], final=i == len(ids) - 1) for i, t in enumerate(ids))
    assert text == decode(ids)
    return counting


@pytest.mark.parametrize("kind", ["random", "cjk_bytes", "invalid_lead_bytes", "emoji_bytes"])
def test_decode_work_grows_linearly(tok, decode, byte_ids, kind) -> None:
    rng = random.Random(5)

    def ids_of(n: int) -> list[int]:
        if kind == "random":
            return [rng.randrange(len(tok)) for _ in range(n)]
        if kind == "cjk_bytes":
            return as_byte_tokens(
                "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(n // 3)), byte_ids
            )
        if kind == "emoji_bytes":
            return as_byte_tokens(
                "".join(chr(rng.randrange(0x1F600, 0x1F64F)) for _ in range(n // 4)), byte_ids
            )
        return [byte_ids[0xE4]] * n  # never a complete character: the stuck-tail path

    small, large = decode_work(decode, ids_of(1000)), decode_work(decode, ids_of(4000))
    # Quadratic (the whole output decoded per token) would be ~500x the ids for 1,000 tokens and
    # grow 16x from 1,000 to 4,000; here each token costs a small constant.
    assert small.ids <= 48 * 1000 and large.ids <= 48 * 4000, (small.ids, large.ids)
    assert large.ids <= 4.5 * small.ids and large.calls <= 4.5 * small.calls
