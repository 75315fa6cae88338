"""Coverage-guided fuzzing (atheris / libFuzzer) of everything that parses bytes a client or a peer sends.

One module per target, each with ``one_input(data: bytes) -> None``: it feeds the bytes to the server's
own parsing code and returns when the outcome is a parsed value or one of the rejections the server
maps to a 4xx; anything else raises (a finding). ``python -m cluster.bench.fuzz --target NAME
--seconds N`` runs one under libFuzzer; ``--all`` runs each in turn and prints a table; ``make fuzz``
runs them all for ``FUZZ_SECONDS``. The seeds are in ``corpus/<target>/``; reproducers of findings
not fixed yet in ``findings/``. ``tests/unit/cluster/bench/test_fuzz_targets.py`` runs every ``one_input`` over its
seeds and a few hundred mutations of them without atheris (CI's seconds).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """A fuzz target: its module (``cluster.bench.fuzz.<name>``), the longest input libFuzzer makes,
    and the packages atheris instruments for coverage when the module is imported."""

    name: str
    max_len: int
    instrument: tuple[str, ...]
    about: str


_OURS = ("router", "encoder_service", "llm_service", "mmcore")

TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("chat_body", 8192, (*_OURS, "starlette"), "chat-completions body: bytes -> ingress parsing"),
        Target("completions_body", 8192, (*_OURS, "starlette"), "completions body: bytes -> ingress parsing"),
        Target("responses_body", 8192, (*_OURS, "starlette"), "responses body: bytes -> ingress parsing"),
        Target("data_url", 4096, _OURS, "data: URL of a media part -> its bytes"),
        Target("image", 16384, (*_OURS, "PIL"), "image bytes -> RGB, with the pixel limits"),
        Target("video", 32768, (*_OURS, "av"), "video bytes -> sampled frames, with the frame limits"),
        Target("audio", 32768, (*_OURS, "av", "soundfile"), "audio bytes -> mono at 16 kHz, with limits"),
        Target("link_frames", 2048, _OURS, "direct link: a peer's msgpack header frame"),
        Target("wire_records", 4096, _OURS, "mmcore.wire: a record's msgpack form"),
    )
}
