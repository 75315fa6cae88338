"""The benchmark's scenarios: which requests each one sends (OpenAI chat messages, media generated here).

Every run draws a ``run_id``; media seeds and ``uuid`` values derive from it, so a run against a
long-lived server starts cold even if an earlier run sent "the same" scenario.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from cluster.bench.media import make_audio_bytes, make_image_bytes
from cluster.bench.stats import Comparison

VL_MODEL = "tiny-qwen2-vl"
AUDIO_MODEL = "tiny-qwen2-audio"

TOPICS = ["harbour", "glacier", "orchard", "market", "lighthouse", "canyon", "library", "volcano"]


@dataclass(frozen=True)
class RequestSpec:
    kind: str  # "text" | "image" | "audio": the row a mixed scenario reports it under
    model: str
    content: list[Mapping[str, object]]  # OpenAI content parts, with mmserve's extensions (``uuid``)

    def messages(self) -> list[dict[str, object]]:
        return [{"role": "user", "content": self.content}]


@dataclass(frozen=True)
class Scenario:
    name: str
    requests: list[RequestSpec]
    split_by_kind: bool = False  # also report one row per kind of request (the mix)
    description: str = ""


@dataclass(frozen=True)
class WorkloadConfig:
    num_requests: int = 32
    image_width: int = 224
    image_height: int = 224
    audio_seconds: float = 2.0
    vl_model: str = VL_MODEL
    audio_model: str | None = AUDIO_MODEL  # None: the mix has no audio
    run_id: int = 0


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def text_request(cfg: WorkloadConfig, i: int) -> RequestSpec:
    topic = TOPICS[i % len(TOPICS)]
    text = f"Request {cfg.run_id}-{i}: describe a quiet morning at the {topic} in a few short sentences."
    return RequestSpec("text", cfg.vl_model, [{"type": "text", "text": text}])


def image_request(cfg: WorkloadConfig, tag: str, i: int, send_bytes: bool = True) -> RequestSpec:
    """An image with a ``uuid``; ``send_bytes=False`` sends the uuid alone (served from the cache)."""
    part: dict[str, object] = {"type": "image_url", "uuid": f"bench-{cfg.run_id}-{tag}-{i}"}
    if send_bytes:
        png = make_image_bytes(cfg.image_width, cfg.image_height, seed=_seed(cfg, tag, i))
        part["image_url"] = {"url": data_url(png, "image/png")}
    text = {"type": "text", "text": "Describe this image in a few short sentences."}
    return RequestSpec("image", cfg.vl_model, [part, text])


def audio_request(cfg: WorkloadConfig, tag: str, i: int) -> RequestSpec:
    if cfg.audio_model is None:
        raise ValueError("no audio model configured")
    freq = 220.0 + 10.0 * (i % 50)
    wav = make_audio_bytes(cfg.audio_seconds, freq=freq, seed=_seed(cfg, tag, i))
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    text = {"type": "text", "text": "What do you hear in this recording?"}
    return RequestSpec("audio", cfg.audio_model, [part, text])


def _seed(cfg: WorkloadConfig, tag: str, i: int) -> int:
    return (cfg.run_id * 1_000_003 + sum(map(ord, tag)) * 10_007 + i) % 2**32


def mix_requests(cfg: WorkloadConfig) -> list[RequestSpec]:
    """``num_requests`` of each kind, interleaved (t, i, a, t, ...): text arrives among media."""
    makers: list[Callable[[int], RequestSpec]] = [
        lambda i: text_request(cfg, 10_000 + i),
        lambda i: image_request(cfg, "mix", i),
    ]
    if cfg.audio_model is not None:
        makers.append(lambda i: audio_request(cfg, "mix", i))
    k = len(makers)
    return [makers[i % k](i // k) for i in range(cfg.num_requests * k)]


def build_scenarios(cfg: WorkloadConfig) -> list[Scenario]:
    """The rows, in the order they must run (warm and uuid rows reuse the cold row's images)."""
    n = cfg.num_requests
    cold = [image_request(cfg, "img", i) for i in range(n)]
    scenarios = [
        Scenario("text", [text_request(cfg, i) for i in range(n)], description="text only (baseline)"),
        Scenario("images-cold", cold, description="distinct images: encoder cache and prefix cache cold"),
        Scenario("images-warm", list(cold), description="the same requests again: both caches warm"),
        Scenario(
            "images-uuid",
            [image_request(cfg, "img", i, send_bytes=False) for i in range(n)],
            description="the same images by uuid alone: cache hits without bytes",
        ),
        Scenario(
            "mix",
            mix_requests(cfg),
            split_by_kind=True,
            description="text + new images + audio interleaved, concurrently",
        ),
    ]
    return scenarios


def warmup_requests(cfg: WorkloadConfig) -> list[RequestSpec]:
    """One request of each kind, media unlike any scenario's, so first-call costs stay out of the rows."""
    specs = [text_request(cfg, -1), image_request(cfg, "warmup", 0)]
    if cfg.audio_model is not None:
        specs.append(audio_request(cfg, "warmup", 0))
    return specs


COMPARISONS = [
    Comparison("images cost vs text (cold caches)", "images-cold", "text"),
    Comparison("warm encoder + prefix cache", "images-warm", "images-cold"),
    Comparison("cache hit by uuid, no bytes", "images-uuid", "images-cold"),
    Comparison("text never queues behind media", "mix:text", "text"),
]
