"""The sampler's CPU cost per step: ``python -m cluster.bench.sampler``.

A batch of 32 rows (and other sizes) at a vocabulary of the tiny models (1024) and of a real Qwen
checkpoint (151,936): all greedy, all random (temperature + top-p), and the mixed batch apps send
(greedy, seeded, top-k/top-p/min-p, penalties over a 64-token history, logit_bias, min_tokens, a
grammar mask on a quarter of the rows). Each step appends the sampled tokens to the rows' outputs, as
decoding does. ``--engine`` adds a decode step of the tiny model at the same batch, all greedy, mixed,
and all greedy under the serving benchmark's JSON schema (``DIGITS_SCHEMA``: the grammar's bitmask and
matchers).

Every case is built once (one engine per engine case) and the cases' steps run interleaved, in blocks
of ``--steps`` steps (greedy, mixed, schema, greedy, mixed, ...; ``--blocks`` blocks per round), so a
burst of load from other processes falls on every case alike. Each step's CPU time is read with
``time.thread_time`` (one torch thread, as the engine runs on CPU; what the setup allocated is frozen
out of the garbage collector's scans). The engine cases take turns among themselves, as do each
vocabulary's sampler cases. A case's reading is a low percentile of its steps (``p10``: on a shared host
the low end is the reading least inflated by other work) with its median and ``p90`` as the spread; its
ratio to all-greedy is the ratio of the p10s, and ``windows`` gives the range of the ratio over ten
windows of consecutive blocks (each window's median over all-greedy's median in the same blocks).

``--rounds N`` repeats the whole measurement N times in fresh child processes; ``--baseline REF``
alternates them with the ``llm_service`` package of a git revision.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from llm_service import sampler as sampler_module
from llm_service.logits_processors import GrammarMasks
from llm_service.sampling_params import SamplingParams
from llm_service.structured.spec import StructuredSpec

# "<batch>/<vocab>/<case>" or "<batch>/engine/<case>" -> the CPU-ms of its steps, one list per block
Results = dict[str, list[list[float]]]
Step = Callable[[], object]


@dataclass
class Row:
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset({0})


def mixed_params(n: int) -> list[SamplingParams]:
    kinds = [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=0.7, top_k=40, min_p=0.05),
        SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(repetition_penalty=1.1),
        SamplingParams(temperature=0.6, logit_bias=((5, 2.0), (9, -5.0))),
        SamplingParams(min_tokens=100, max_tokens=200),
        SamplingParams(temperature=0.9, top_p=0.95, seed=2),
    ]
    return [kinds[i % len(kinds)] for i in range(n)]


# The serving benchmark's schema (docs/benchmarks.md, run AT): an array of 40 digits, which 16 tokens
# cannot close, so every request decodes under the grammar to its last token.
DIGITS_SCHEMA = {
    "type": "object",
    "properties": {
        "digits": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 40,
            "maxItems": 40,
        }
    },
    "required": ["digits"],
    "additionalProperties": False,
}


def digits_schema(items: int) -> dict[str, Any]:
    """``DIGITS_SCHEMA`` with ``items`` digits: the engine's requests stay under it for every step."""
    digits = {**DIGITS_SCHEMA["properties"]["digits"], "minItems": items, "maxItems": items}  # type: ignore[index]
    return {**DIGITS_SCHEMA, "properties": {"digits": digits}}


def sampler_cases(batch: int, vocab: int) -> dict[str, Step]:
    """One sampling step per case, as the engine calls the sampler, on fixed logits."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=g)
    words = (vocab + 31) // 32
    masks = GrammarMasks(
        torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32), list(range(0, batch, 4))
    )
    cases: dict[str, tuple[list[SamplingParams], GrammarMasks | None]] = {
        "all greedy": ([SamplingParams()] * batch, None),
        "all random (T, top-p)": ([SamplingParams(temperature=0.8, top_p=0.9)] * batch, None),
        "mixed": (mixed_params(batch), None),
        "mixed + grammar (1/4 rows)": (mixed_params(batch), masks),
    }
    return {name: _stepper(logits, params, grammar) for name, (params, grammar) in cases.items()}


def _stepper(logits: torch.Tensor, params: list[SamplingParams], grammar: GrammarMasks | None) -> Step:
    """One decode step's sampling, as the engine calls it (with the state it keeps between steps,
    where this revision has one), its tokens appended to the rows."""
    shared = torch.Generator().manual_seed(0)  # the engine's default generator: the unseeded rows'
    gens = [shared if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
    rows = [Row(list(range(i, i + 200)), list(range(i, i + 64))) for i in range(len(params))]
    extra: list[Any] = []
    state_cls = getattr(sampler_module, "SamplerState", None)
    if state_cls is not None:
        extra = [state_cls(), list(range(len(rows)))]

    @torch.inference_mode()  # as the engine's step runs
    def step() -> object:
        tokens, _ = sampler_module.sample(logits, params, gens, rows, grammar, *extra)
        for row, t in zip(rows, tokens, strict=True):
            row.output_token_ids.append(t)
        return tokens

    return step


def engine_cases(model_dir: str, batch: int, total_steps: int) -> dict[str, Step]:
    """A decode step of ``batch`` requests (the tiny model's forward and the sampler) per case, each
    case on its own engine, its requests prefilled and long enough for ``total_steps`` steps."""
    schema = SamplingParams(
        structured=StructuredSpec.json_schema(digits_schema(total_steps), "response_format")
    )
    cases = {
        "all greedy": [SamplingParams()] * batch,
        "mixed": mixed_params(batch),
        "all greedy + schema": [schema] * batch,
    }
    return {name: _engine(model_dir, params, total_steps).step for name, params in cases.items()}


def _engine(model_dir: str, params: list[SamplingParams], total_steps: int) -> Any:
    from llm_service.config import EngineConfig
    from llm_service.engine import LLMEngine

    prompt = 64
    blocks = len(params) * ((prompt + total_steps + 31) // 16)
    eng = LLMEngine(EngineConfig(model=model_dir, max_num_seqs=len(params), num_kv_blocks=blocks))
    for i, p in enumerate(params):
        eng.add_request(
            f"r{i}",
            [(7 * i + j) % 900 + 20 for j in range(prompt)],
            replace(
                p, max_tokens=total_steps + 8, min_tokens=min(p.min_tokens, total_steps), ignore_eos=True
            ),
        )
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()  # the prefills
    return eng


def interleave(cases: dict[str, Step], steps: int, blocks: int, warmup: int = 3) -> Results:
    """Each case's per-step CPU-ms, its steps run in blocks of ``steps``, the cases taking turns."""
    for step in cases.values():
        for _ in range(warmup):
            step()
    gc.collect()
    gc.freeze()  # what the setup made is never scanned again: a collection inside a step stays short
    out: Results = {name: [] for name in cases}
    for _ in range(blocks):
        for name, step in cases.items():
            samples = []
            for _ in range(steps):
                t = time.thread_time()
                step()
                samples.append((time.thread_time() - t) * 1e3)
            out[name].append(samples)
    return out


def measure(batches: list[int], vocabs: list[int], steps: int, blocks: int, engine: str | None) -> Results:
    """Each group of cases interleaved among itself: a batch's engines, then each vocabulary's
    sampler cases (an engine's step between two sampler steps would evict the sampler's caches)."""
    torch.set_num_threads(1)
    res: Results = {}
    for b in batches:
        if engine:
            cases = engine_cases(engine, b, steps * blocks + 3)
            res.update({f"{b}/engine/{k}": v for k, v in interleave(cases, steps, blocks).items()})
            del cases
        for v in vocabs:
            got = interleave(sampler_cases(b, v), steps, blocks)
            res.update({f"{b}/{v}/{k}": x for k, x in got.items()})
    return res


def _child(tree: str | None, args: argparse.Namespace) -> Results:
    """``measure`` in a child process, with ``tree``'s ``llm_service`` first on the path (``-P``: not
    the working directory's)."""
    cmd = [sys.executable, "-P", "-m", "cluster.bench.sampler", "--child", "--steps", str(args.steps)]
    cmd += ["--blocks", str(args.blocks), "--batch", *map(str, args.batch), "--vocab", *map(str, args.vocab)]
    if args.engine:
        cmd += ["--engine", args.engine]
    env = dict(os.environ)
    path = [os.getcwd(), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join([tree, *path] if tree else path)
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return {k: v for k, v in json.loads(out.splitlines()[-1]).items()}


def _baseline_tree(ref: str, into: str) -> str:
    """``ref``'s ``llm_service`` package, extracted under ``into`` (the rest comes from the tree)."""
    archive = subprocess.run(["git", "archive", ref, "llm_service"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-quantile of ``xs`` (nearest rank)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


@dataclass(frozen=True)
class Summary:
    p10: float
    p50: float
    p90: float
    ratio: float  # p10 over all-greedy's p10
    block_ratios: tuple[float, float]  # min and max of the windows' median ratios


def summarize(blocks: list[list[float]], greedy: list[list[float]], windows: int = 10) -> Summary:
    """A case's steps (by block) against the all-greedy case's steps of the same blocks; the spread
    of the ratio over ``windows`` runs of consecutive blocks (each window's medians)."""
    flat, base = [x for b in blocks for x in b], [x for b in greedy for x in b]
    size = max(1, len(blocks) // windows)
    per_block = [
        percentile(_flat(blocks[i : i + size]), 0.5) / percentile(_flat(greedy[i : i + size]), 0.5)
        for i in range(0, len(blocks) - size + 1, size)
    ]
    p10 = percentile(flat, 0.1)
    return Summary(
        p10,
        percentile(flat, 0.5),
        percentile(flat, 0.9),
        p10 / percentile(base, 0.1),
        (min(per_block), max(per_block)),
    )


def _flat(blocks: list[list[float]]) -> list[float]:
    return [x for b in blocks for x in b]


def table(runs: dict[str, list[Results]]) -> list[str]:
    """One row per case and tree: each round's p10 ratio, then the rounds pooled (p10 / p50 / p90
    CPU-ms, the ratio of the p10s, the per-block ratios' range)."""
    head = "| batch | vocab | case | tree | ratio by round | p10 / p50 / p90 CPU-ms | × greedy | windows |"
    lines = [head, "|---:|---:|---|---|---|---:|---:|---|"]
    keys = list(dict.fromkeys(k for rounds in runs.values() for r in rounds for k in r))
    for key in keys:
        b, v, case = key.split("/", 2)
        greedy = f"{b}/{v}/all greedy"
        for label, rounds in runs.items():
            have = [r for r in rounds if key in r and greedy in r]
            if not have:
                continue
            by_round = " ".join(f"{summarize(r[key], r[greedy]).ratio:.2f}" for r in have)
            s = summarize([x for r in have for x in r[key]], [x for r in have for x in r[greedy]])
            lines.append(
                f"| {b} | {v} | {case} | {label} | {by_round} | {s.p10:.3f} / {s.p50:.3f} / {s.p90:.3f}"
                f" | {s.ratio:.2f} | {s.block_ratios[0]:.2f}–{s.block_ratios[1]:.2f} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cluster.bench.sampler", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[32])
    ap.add_argument("--vocab", type=int, nargs="+", default=[1024, 151936])
    ap.add_argument("--steps", type=int, default=2, help="steps per block")
    ap.add_argument("--blocks", type=int, default=150, help="blocks per case and round")
    ap.add_argument(
        "--engine", help="also time whole decode steps of this model directory (e.g. a tiny model)"
    )
    ap.add_argument("--baseline", help="a git revision whose llm_service to time against the working tree's")
    ap.add_argument(
        "--rounds", type=int, default=1, help="child processes per tree (alternating with --baseline)"
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.batch, args.vocab, args.steps, args.blocks, args.engine)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        base = _baseline_tree(args.baseline, tmp) if args.baseline else None
        runs: dict[str, list[Results]] = {args.baseline: []} if args.baseline else {}
        runs["now"] = []
        for _ in range(args.rounds):
            if base is not None:
                runs[args.baseline].append(_child(base, args))
            runs["now"].append(_child(None, args))
    print("\n".join(table(runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
