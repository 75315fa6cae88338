"""Writes the seed corpus, ``corpus/<target>/`` (``python -m cluster.bench.fuzz.seeds``; the bytes are
committed, so run it again only to change them). A handful of small valid and near-valid inputs each;
every file under 20 KB. Media is made here with Pillow, PyAV and soundfile."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable, Mapping
from fractions import Fraction
from pathlib import Path

import msgpack
import numpy as np

HERE = Path(__file__).resolve().parent
MAX_SEED_BYTES = 20 * 1024


def _png(w: int = 16, h: int = 16) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 60)).save(buf, "PNG")
    return buf.getvalue()


def image_seeds() -> dict[str, bytes]:
    from PIL import Image

    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 255, (32, 48, 3), dtype=np.uint8))
    out = {}
    for fmt, ext, mode in (
        ("PNG", "png", "RGB"),
        ("JPEG", "jpg", "RGB"),
        ("GIF", "gif", "P"),
        ("WEBP", "webp", "RGB"),
        ("BMP", "bmp", "RGB"),
        ("PNG", "la.png", "LA"),
        ("JPEG", "cmyk.jpg", "CMYK"),
    ):
        buf = io.BytesIO()
        noise.convert(mode).save(buf, fmt)
        out[f"noise.{ext}"] = buf.getvalue()
    big = io.BytesIO()
    Image.new("L", (400, 300)).save(big, "PNG")  # 120,000 pixels: past the target's max_pixels
    out["over_max_pixels.png"] = big.getvalue()
    png = bytearray(_png())
    png[16:24] = (30000).to_bytes(4, "big") + (30000).to_bytes(4, "big")  # IHDR lies about its size
    out["lying_header.png"] = bytes(png)
    out["truncated.jpg"] = out["noise.jpg"][: len(out["noise.jpg"]) // 2]
    return out


def _video(
    container: str, codec: str, w: int = 32, h: int = 24, n: int = 6, pix_fmt: str = "yuv420p"
) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=4)
        stream.width, stream.height, stream.pix_fmt = w, h, pix_fmt
        stream.time_base = Fraction(1, 4)
        for i in range(n):
            img = np.full((h, w, 3), (10 + 30 * i) % 256, np.uint8)
            img[: h // 2, : w // 2] = (255 - 30 * i) % 256
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            frame.pts = i
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return buf.getvalue()


def video_seeds() -> dict[str, bytes]:
    out = {
        "h264.mp4": _video("mp4", "libx264"),
        "mpeg4.avi": _video("avi", "mpeg4"),
        "vp9.webm": _video("webm", "libvpx-vp9"),
        "mjpeg.mkv": _video("matroska", "mjpeg", pix_fmt="yuvj420p"),
        "mpeg2.ts": _video("mpegts", "mpeg2video"),
        "too_many_frames.mp4": _video("mp4", "mpeg4", w=16, h=16, n=40),
    }
    out["truncated.mp4"] = out["h264.mp4"][: len(out["h264.mp4"]) * 2 // 3]
    return out


def _sine(rate: int, seconds: float, channels: int = 1) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    wave = (np.sin(2 * np.pi * 440 * t) * 0.3).astype(np.float32)
    return np.repeat(wave[:, None], channels, axis=1)


def _soundfile(fmt: str, subtype: str, rate: int, seconds: float, channels: int = 1) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, _sine(rate, seconds, channels), rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def _av_audio(container: str, codec: str, rate: int, seconds: float) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(_sine(rate, seconds).T.copy(), format="fltp", layout="mono")
        frame.sample_rate = rate
        out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return buf.getvalue()


def audio_seeds() -> dict[str, bytes]:
    return {
        "pcm16.wav": _soundfile("WAV", "PCM_16", 8000, 0.25),
        "float_stereo.wav": _soundfile("WAV", "FLOAT", 8000, 0.1, channels=2),
        "u8.wav": _soundfile("WAV", "PCM_U8", 16000, 0.2),
        "pcm16.flac": _soundfile("FLAC", "PCM_16", 22050, 0.2),
        "vorbis.ogg": _soundfile("OGG", "VORBIS", 16000, 0.3),
        "mp3.mp3": _av_audio("mp3", "libmp3lame", 16000, 0.3),
        "alaw_in_wav.wav": _soundfile("WAV", "ALAW", 8000, 0.1),
    }


def _body(**fields: object) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def chat_body_seeds() -> dict[str, bytes]:
    png = base64.b64encode(_png(4, 4)).decode()
    wav = base64.b64encode(_soundfile("WAV", "PCM_16", 8000, 0.01)).decode()
    user = {"role": "user", "content": "hi"}
    media = {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}", "detail": "low"}},
            {"type": "image_url", "uuid": "cached-1"},
            {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
        ],
    }
    return {
        "text.json": _body(messages=[user]),
        "sampling.json": _body(
            messages=[
                {"role": "developer", "content": "be brief"},
                user,
                {"role": "assistant", "content": None},
            ],
            max_tokens=8,
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            seed=-3,
            stop=["\n\n", "END"],
            logprobs=True,
            top_logprobs=2,
            stream=True,
            stream_options={"include_usage": True},
            cache_salt="s",
        ),
        "media.json": _body(messages=[media], max_completion_tokens=4),
        "video_url.json": _body(
            messages=[
                {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}]}
            ]
        ),
        "bad_base64_audio.json": _body(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "input_audio", "input_audio": {"data": "@@", "format": "mp3"}}],
                }
            ]
        ),
        "penalty.json": _body(messages=[user], presence_penalty=0.5, logit_bias={"1": 2}),
        "nested.json": b'{"model":"m","messages":[{"role":"user","content":"x"}],"user":'
        + b"[" * 64
        + b"]" * 64
        + b"}",
        "many_values.json": _body(messages=[user], stop=[","] * 600),
        "escapes.json": b'{"model":"m","messages":[{"role":"user","content":"\\ud800\\u0000\\"\\\\"}],"seed":1e400}',
        "trailing_comma.json": b'{"model":"m","messages":[{"role":"user","content":"hi"},]}',
        "json_schema.json": _body(
            messages=[user],
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "point",
                    "strict": True,
                    "schema": {
                        "type": "object",
                        "properties": {"x": {"type": "integer", "minimum": 0}, "tag": {"enum": ["a", "b"]}},
                        "required": ["x"],
                        "additionalProperties": False,
                    },
                },
            },
        ),
        "json_object.json": _body(messages=[user], response_format={"type": "json_object"}),
        "regex.json": _body(messages=[user], structured_outputs={"regex": "[a-z]{2,5}(-[0-9]+)?"}),
        "choice.json": _body(messages=[user], structured_outputs={"choice": ["yes", "no"]}),
        "grammar.json": _body(messages=[user], structured_outputs={"grammar": 'root ::= "a" | "b" root'}),
        "json_string.json": _body(messages=[user], structured_outputs={"json": '{"type": "string"}'}),
        **tool_seeds(user, png),
    }


def tool_seeds(user: Mapping[str, object], png: str) -> dict[str, bytes]:
    """Tools in the prompt (docs/tools.md): the agent loop's step with a screenshot in the tool's answer,
    and a named ``tool_choice`` over a nested schema."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "click",
                "description": "click",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "at": {"type": "array", "items": {"type": "integer"}},
                        "mode": {"enum": ["l", "r"]},
                    },
                    "required": ["at"],
                    "anyOf": [{"required": ["mode"]}, True],
                },
                "strict": True,
            },
        },
        {"type": "function", "function": {"name": "screenshot"}},
    ]
    call = {"id": "c1", "type": "function", "function": {"name": "click", "arguments": '{"at": [1, 2]}'}}
    shot = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}
    loop = [
        {"role": "user", "content": [{"type": "text", "text": "go"}, shot]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "now"}, shot]},
    ]
    return {
        "tools_agent_loop.json": _body(
            messages=loop, tools=tools, tool_choice="auto", parallel_tool_calls=False
        ),
        "tools_named_choice.json": _body(
            messages=[user], tools=tools, tool_choice={"type": "function", "function": {"name": "click"}}
        ),
    }


def completions_body_seeds() -> dict[str, bytes]:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    return {
        "string.json": _body(prompt="Once upon a time", max_tokens=8),
        "strings.json": _body(prompt=["a", "bb", "ccc"], max_tokens=4, n=2),
        "ids.json": _body(prompt=[1, 2, 3, 1023], max_tokens=4),
        "id_lists.json": _body(prompt=[[1, 2], [3, 4, 5]], echo=True, logprobs=2),
        "echo_logprobs.json": _body(prompt="x", echo=True, logprobs=5, max_tokens=1),
        "sampling.json": _body(
            prompt="p",
            temperature=0.7,
            top_p=0.9,
            top_k=5,
            min_p=0.1,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.2,
            logit_bias={"5": 10, "7": -100},
            seed=3,
            stop=["\n", "."],
            stream=True,
            stream_options={"include_usage": True},
            min_tokens=2,
            stop_token_ids=[4],
        ),
        "json_schema.json": _body(
            prompt="json:",
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
        ),
        "regex.json": _body(prompt="r", structured_outputs={"regex": "[a-z]{1,4}"}),
        "suffix.json": _body(prompt="a", suffix="b"),
        "unknown_field.json": _body(prompt="a", best_of=2),
        "bad_ids.json": _body(prompt=[-1, 99999]),
        "cache_salt.json": _body(prompt="a", cache_salt="s1", user="u"),
    }


def responses_body_seeds() -> dict[str, bytes]:
    png = "data:image/png;base64," + base64.b64encode(_png(4, 4)).decode()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tool = {
        "type": "function",
        "name": "click",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
    }
    return {
        "text.json": _body(input="Describe a cat.", max_output_tokens=16),
        "instructions.json": _body(input="hi", instructions="Answer briefly.", temperature=0.5, top_p=0.9),
        "items.json": _body(
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": png},
                    ],
                },
                {"role": "assistant", "content": [{"type": "output_text", "text": "A square."}]},
                {"role": "user", "content": "And now?"},
            ]
        ),
        "json_schema.json": _body(
            input="json",
            text={"format": {"type": "json_schema", "name": "r", "schema": schema, "strict": True}},
        ),
        "json_object.json": _body(input="json", text={"format": {"type": "json_object"}}),
        "tools.json": _body(
            input="click it", tools=[tool], tool_choice="required", parallel_tool_calls=False
        ),
        "function_output.json": _body(
            input=[
                {"role": "user", "content": "click"},
                {"type": "function_call", "call_id": "c1", "name": "click", "arguments": '{"x": 1}'},
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [{"type": "input_image", "image_url": png}],
                },
            ],
            tools=[tool],
        ),
        "stream.json": _body(input="hi", stream=True, metadata={"k": "v"}, user="u"),
        "previous_response_id.json": _body(input="hi", previous_response_id="resp_1"),
        "file_id.json": _body(input=[{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]),
        "hosted_tool.json": _body(input="hi", tools=[{"type": "web_search"}]),
        "unknown_field.json": _body(input="hi", best_of=2),
    }


def data_url_seeds() -> dict[str, bytes]:
    png = base64.b64encode(_png(4, 4)).decode()
    return {
        "png_b64.bin": b"\x00data:image/png;base64," + png.encode(),
        "percent.bin": b"\x01data:video/mp4,%00%01abc%ff",
        "plain_text.bin": b"\x02data:,hello%20world",
        "no_comma.bin": b"\x00data:image/png;base64",
        "bad_b64.bin": b"\x00data:;base64,AAA=A===",
        "too_large.bin": b"\x02data:audio/wav;base64," + b"A" * 3000,
        "not_data.bin": b"\x00https://example.com/a.png",
        "surrogate.bin": b"\x00DATA:image/png;charset=\xff;base64,\xed\xa0\x80",
    }


def link_frames_seeds() -> dict[str, bytes]:
    frames = {
        "call.bin": [7, "prepare", 5000],
        "cancel.bin": [7, None],
        "failed.bin": [9, 2, "busy", "1024 calls in flight"],
        "ok.bin": [9, 0],
        "more.bin": [9, 3],
        "raised.bin": [9, 1],
        "short.bin": [1],
        "not_int.bin": ["x", 0],
    }
    out = {name: bytes(msgpack.packb(f)) for name, f in frames.items()}
    out["truncated.bin"] = out["failed.bin"][:-3]
    return out


def wire_records_seeds() -> dict[str, bytes]:
    from cluster.bench.fuzz.wire_records import KINDS
    from encoder_service.types import EmbeddingMeta
    from mmcore.wire import WIRE_VERSION, pack

    meta = EmbeddingMeta("h" * 16, "video", 12, 64, "bfloat16", (2, 4, 6), 0.5, [0.0, 1.0], 4, 1)
    out = {"embedding_meta.bin": bytes([0]) + meta.to_msgpack()}
    out["embedding_meta_missing.bin"] = bytes([0]) + pack(
        "EmbeddingMeta", {"mm_hash": "a", "modality": "image"}
    )
    out["embedding_meta_old.bin"] = bytes([0]) + bytes(
        msgpack.packb({"v": WIRE_VERSION - 1, "kind": "EmbeddingMeta"})
    )
    for i, kind in enumerate(KINDS[1:], start=1):
        out[f"{kind}.bin"] = bytes([i]) + pack(kind, {"request_id": "r", "items": [], "inputs": []})
    out["wrong_kind.bin"] = bytes([2]) + pack("EncodeBatch", {})
    return out


SEEDS: dict[str, Callable[[], dict[str, bytes]]] = {
    "chat_body": chat_body_seeds,
    "completions_body": completions_body_seeds,
    "responses_body": responses_body_seeds,
    "data_url": data_url_seeds,
    "image": image_seeds,
    "video": video_seeds,
    "audio": audio_seeds,
    "link_frames": link_frames_seeds,
    "wire_records": wire_records_seeds,
}


def write_all() -> None:
    for target, make in SEEDS.items():
        folder = HERE / "corpus" / target
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.iterdir():
            old.unlink()
        for name, data in make().items():
            assert len(data) < MAX_SEED_BYTES, (target, name, len(data))
            (folder / name).write_bytes(data)
        print(
            f"{target}: {len(list(folder.iterdir()))} seeds, {sum(f.stat().st_size for f in folder.iterdir())} bytes"
        )


if __name__ == "__main__":
    write_all()
