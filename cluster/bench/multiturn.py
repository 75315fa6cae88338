"""Multi-turn image chat, hybrid against pure attention: ``python -m cluster.bench.multiturn``.

Writes a tiny Qwen3.5 (hybrid: Gated DeltaNet + gated attention) and a tiny Qwen3-VL (pure attention)
with the project's generator (same tokenizer, template and sizes, 4 decoder layers each), then for
each one in turn starts ``mmserve serve --model DIR`` on 127.0.0.1, runs one unmeasured conversation,
then ``--conversations`` conversations of ``--turns`` turns, at most ``--concurrency`` conversations
at once, and stops it; ``--rounds`` repeats that for every server in turn and pools the turns.
``--snapshot-intervals`` runs the hybrid once per snapshot policy (``llm.snapshot_interval_blocks``). Turn 1 sends a distinct image (per conversation) and a question; every later
turn re-sends the whole conversation, image included, with the server's own previous answers and a
new question (``--answers fixed``: one fixed answer text instead). Streaming, temperature 0,
``--max-tokens`` with ``ignore_eos``. Per turn it reports mean and p50 TTFT (to the first chunk with
content) and the prefix-cache hit rate, Σ ``usage.prompt_tokens_details.cached_tokens`` / Σ
``usage.prompt_tokens``, and the hybrid over the attention model. ``--vllm`` runs the same workload
against vLLM 0.32 (CPU, the peer venv, bfloat16) serving the same Qwen3.5 directory, and prints the
first error line of its log when its requests fail.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import functools
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

import openai

if TYPE_CHECKING:
    from openai.types import CompletionUsage
    from openai.types.chat import ChatCompletionMessageParam

from cluster.bench.client import make_client
from cluster.bench.media import make_image_bytes
from cluster.bench.multiturn_stats import (
    TurnResult,
    TurnRow,
    goal,
    policy_table,
    render_table,
    turn_rows,
)
from cluster.bench.servers import ServerProcess
from cluster.bench.vllm_client import QUIET_ENV, TCMALLOC
from cluster.tiny_model import ModelSize, make_tiny_model

REPO = Path(__file__).resolve().parents[2]
HYBRID, ATTENTION, VLLM = "qwen3.5", "qwen3-vl", "vllm-qwen3.5"
QUESTIONS = ["Describe this image.", "What colours are in it?", "Is there anything else in it?"]
FIXED_ANSWER = "It shows soft waves of colour, a little noise, and no text."  # --answers fixed
WARMUP_SEED = 10_000  # the warm-up conversation's image: no measured conversation shares it


def question(turn: int) -> str:
    return QUESTIONS[turn - 1] if turn <= len(QUESTIONS) else f"Tell me more, part {turn}."


@functools.cache
def system_prompt(words: int) -> str:
    """``words`` words of the project's corpus: the same text for every conversation."""
    text = (REPO / "cluster/data/corpus.txt").read_text().split()
    return " ".join(text[i % len(text)] for i in range(words))


def image_part(seed: int, size: int) -> dict[str, object]:
    data = base64.b64encode(make_image_bytes(size, size, "PNG", seed=seed)).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


async def chat_turn(
    client: openai.AsyncOpenAI, model: str, messages: list[dict[str, object]], max_tokens: int
) -> tuple[str, float | None, CompletionUsage | None]:
    """One streamed request: the answer's text, seconds to the first chunk with content, the usage."""
    start = time.perf_counter()
    ttft: float | None = None
    usage: CompletionUsage | None = None
    parts: list[str] = []
    stream = await client.chat.completions.create(
        model=model,
        messages=cast("list[ChatCompletionMessageParam]", messages),  # built here in the OpenAI shape
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - start
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    return "".join(parts), ttft, usage


async def conversation(
    client: openai.AsyncOpenAI, model: str, conv: int, image_seed: int, args: argparse.Namespace
) -> list[TurnResult]:
    """``args.turns`` turns, each re-sending the conversation so far; a failed turn ends it."""
    messages: list[dict[str, object]] = []
    if args.system_words:  # one long system prompt shared by every conversation (ahead of its image)
        messages.append({"role": "system", "content": system_prompt(args.system_words)})
    results = []
    for turn in range(1, args.turns + 1):
        text = {"type": "text", "text": question(turn)}
        content = [image_part(image_seed, args.image_size), text] if turn == 1 else question(turn)
        messages.append({"role": "user", "content": content})
        try:
            answer, ttft, usage = await chat_turn(client, model, messages, args.max_tokens)
        except Exception as e:  # one failed turn in the table, not the end of the run
            results.append(TurnResult(conv, turn, ok=False, error=f"{type(e).__name__}: {e}"[:500]))
            break
        details = getattr(usage, "prompt_tokens_details", None)
        results.append(
            TurnResult(
                conv,
                turn,
                ok=ttft is not None,
                ttft_s=ttft,
                prompt_tokens=usage.prompt_tokens if usage else 0,
                cached_tokens=(details.cached_tokens or 0) if details is not None else 0,
                error=None if ttft is not None else "no content streamed",
            )
        )
        messages.append(
            {"role": "assistant", "content": answer if args.answers == "server" else FIXED_ANSWER}
        )
    return results


async def run_workload(base_url: str, model: str, args: argparse.Namespace) -> list[TurnResult]:
    client = make_client(base_url + "/v1", timeout_s=300)
    await conversation(client, model, -1, WARMUP_SEED, args)  # unmeasured: first requests pay warm-up
    sem = asyncio.Semaphore(args.concurrency)

    async def one(conv: int) -> list[TurnResult]:
        async with sem:
            return await conversation(client, model, conv, args.seed + conv, args)

    done = await asyncio.gather(*(one(c) for c in range(args.conversations)))
    await client.close()
    return [r for conv in done for r in conv]


def model_dir(out_dir: Path, family: str) -> Path:
    path = out_dir / f"tiny-{family}"
    if not (path / "mmserve_tiny.json").exists():
        make_tiny_model(path, family, ModelSize(num_layers=4))  # Qwen3.5's minimum: 3 linear + 1 attention
    return path


def mmserve_server(
    name: str, path: Path, args: argparse.Namespace, extra: tuple[str, ...] = (), tag: str = ""
) -> ServerProcess:
    argv = [sys.executable, "-m", "cluster.cli", "serve", "--model", str(path), "--model-name", name]
    argv += ["--host", "127.0.0.1", "--port", str(args.port), *extra]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log = args.out_dir / f"{name}{tag}-serve.log"
    return ServerProcess(name, argv, args.port, log, env=env, cwd=REPO, root_kind="Ray driver")


def vllm_server(name: str, path: Path, args: argparse.Namespace) -> ServerProcess:
    """vLLM 0.32 CPU as ``cluster.bench.vs_vllm`` starts it (peer venv, loopback, tcmalloc + iomp)."""
    env = {**QUIET_ENV, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    iomp = args.vllm_venv / "lib/libiomp5.so"
    if TCMALLOC.exists() and iomp.exists():
        env["LD_PRELOAD"] = f"{TCMALLOC}:{iomp}"
    argv = [str(args.vllm_venv / "bin/python"), str(args.peer_dir / "vllm_cli.py"), "serve", str(path)]
    argv += ["--served-model-name", name, "--host", "127.0.0.1", "--port", str(args.vllm_port)]
    argv += ["--max-model-len", "4096", "--dtype", args.vllm_dtype, "--enable-prefix-caching"]
    log = args.out_dir / f"vllm-{name}-serve.log"
    return ServerProcess(name, argv, args.vllm_port, log, env=env, root_kind="API server")


def root_cause(log: Path) -> str | None:
    """The first ``SomethingError: text`` line of a server's log that is not a consequence (a dead engine)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        m = re.search(r"\b(\w+(?:Error|Exception)): (.+)$", line)
        if m and m.group(1) not in ("EngineDeadError", "APIError") and "ulimit" not in line:
            return f"{m.group(1)}: {m.group(2)}"
    return None


def run_server(server: ServerProcess, model: str, args: argparse.Namespace) -> list[TurnResult] | str:
    """The workload against one server; the error text when it does not start."""
    print(f"{server.name}: {server.describe()}", file=sys.stderr, flush=True)
    try:
        server.start()
        print(
            f"{server.name}: healthy after {server.wait_healthy(args.startup_timeout):.1f} s", file=sys.stderr
        )
        return asyncio.run(run_workload(server.base_url, model, args))
    except RuntimeError as e:
        return str(e)
    finally:
        server.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cluster.bench.multiturn", description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=1, help="conversations in flight at once")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--image-size", type=int, default=224, help="side of each square PNG, px")
    p.add_argument(
        "--answers",
        choices=["server", "fixed"],
        default="server",
        help="what each next turn re-sends as the assistant's answer: the server's reply, or one fixed "
        "text (both models then see the same prompt tokens, so only their caches differ)",
    )
    p.add_argument("--seed", type=int, default=0, help="conversation i's image is drawn with seed+i")
    p.add_argument("--port", type=int, default=8471)
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/mmserve-multiturn"), help="models and logs")
    p.add_argument(
        "--hybrid-dir", type=Path, help="serve this Qwen3.5 directory instead of the generated one"
    )
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--vllm", action="store_true", help="also vLLM 0.32 (CPU) on the same Qwen3.5 directory")
    p.add_argument("--vllm-venv", type=Path, default=Path("/tmp/peer_vllm/venv"))
    p.add_argument("--peer-dir", type=Path, default=REPO.parent / "shared/tools/peer_vllm")
    p.add_argument("--vllm-port", type=int, default=8472)
    p.add_argument(
        "--vllm-dtype",
        default="bfloat16",
        help="vLLM-cpu's Gated DeltaNet kernel asserts BF16 (float32 dies on the first request)",
    )
    p.add_argument(
        "--snapshot-intervals",
        default="16",
        help="the hybrid's snapshot policies to run, comma-separated `llm.snapshot_interval_blocks` "
        "(0: prompt ends only); the first is the one compared in the main table",
    )
    p.add_argument(
        "--system-words",
        type=int,
        default=0,
        help="a system prompt of this many words, shared by every conversation (a long common prefix "
        "that ends inside each first prompt: where interval snapshots pay)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every server this many times, one after the other each round, and pool the turns "
        "(a server's TTFT moves by a few ms from one start to the next on this host)",
    )
    p.add_argument("--json", type=Path, help="write every request and row here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    dirs = {
        HYBRID: args.hybrid_dir or model_dir(args.out_dir, "qwen3.5"),
        ATTENTION: model_dir(args.out_dir, "qwen3-vl"),
    }
    intervals = [int(n) for n in args.snapshot_intervals.split(",")]
    variants = {HYBRID: intervals[0], **{f"{HYBRID} @{n}": n for n in intervals[1:]}}
    servers, names = [], []
    for name, interval in variants.items():
        extra = ("--snapshot-interval-blocks", str(interval))
        servers.append(mmserve_server(f"tiny-{HYBRID}", dirs[HYBRID], args, extra, tag=f"-at-{interval}"))
        names.append(name)
    servers.append(mmserve_server(f"tiny-{ATTENTION}", dirs[ATTENTION], args))
    names.append(ATTENTION)
    if args.vllm:
        servers.append(vllm_server(f"tiny-{HYBRID}", dirs[HYBRID], args))
        names.append(VLLM)
    results: dict[str, list[TurnResult]] = {}
    errors: dict[str, str] = {}
    causes: dict[str, str] = {}
    for _ in range(args.rounds):  # servers in turn, each round: a slow spell of the host hits all
        for name, server in zip(names, servers, strict=True):
            if name in errors:
                continue
            out = run_server(server, server.name, args)
            if isinstance(out, str):
                errors[name] = out
                print(f"{name}: FAILED: {out}", file=sys.stderr)
            else:
                results.setdefault(name, []).extend(out)
    rows: dict[str, list[TurnRow]] = {n: turn_rows(r) for n, r in results.items()}
    print(
        f"\n{args.conversations} conversations x {args.turns} turns x {args.rounds} rounds, "
        f"concurrency {args.concurrency}, system prompt {args.system_words} words, "
        f"{args.image_size} px image, max_tokens {args.max_tokens}, answers: {args.answers}\n"
    )
    print(render_table(rows, HYBRID, ATTENTION))
    verdict: dict[str, float] = {}
    if HYBRID in rows and ATTENTION in rows:
        verdict = goal(rows[HYBRID], rows[ATTENTION])
        hit, ttft = verdict["hit_rate_ratio"], verdict["turn3_ttft_ratio"]
        print(
            f"\ngoal: hit rate {HYBRID}/{ATTENTION} {hit:.2f} (>= 0.9: {hit >= 0.9}), "
            f"turn-3 mean TTFT {ttft:.2f} (<= 1.2: {ttft <= 1.2}), turn-3 p50 TTFT {verdict['turn3_ttft_p50_ratio']:.2f}"
        )
    if len(variants) > 1:
        print(f"\nsnapshot policies of {HYBRID}:\n")
        print(policy_table(rows, variants, ATTENTION))
    for name, err in errors.items():
        print(f"\n{name} failed: {err.splitlines()[-1] if err.strip() else err}")
    failed = [r for rs in results.values() for r in rs if not r.ok]
    for r in failed[:3]:
        print(f"failed request (conversation {r.conversation}, turn {r.turn}): {r.error}", file=sys.stderr)
    for name, server in zip(names, servers, strict=True):
        if any(not r.ok for r in results.get(name, [])) and (cause := root_cause(server.log_path)):
            causes[name] = cause
            print(f"\n{name}: requests failed; the server's log says: {cause}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "requests": {n: [dataclasses.asdict(r) for r in rs] for n, rs in results.items()},
                    "rows": {
                        n: [{**dataclasses.asdict(r), "hit_rate": r.hit_rate} for r in rs]
                        for n, rs in rows.items()
                    },
                    "goal": {k: (None if math.isnan(v) else v) for k, v in verdict.items()},
                    "errors": errors,
                    "causes": causes,
                },
                indent=2,
            )
        )
    return 0 if results and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
