"""The sampler's CPU cost per step: ``python -m cluster.bench.sampler``.

A batch of 32 rows (and other sizes) at a vocabulary of the tiny models (1024) and of a real Qwen
checkpoint (151,936): all greedy, all random (temperature + top-p), and the mixed batch apps send
(greedy, seeded, top-k/top-p/min-p, penalties over a 64-token history, logit_bias, min_tokens, a
grammar mask on a quarter of the rows). Each step appends the sampled tokens to the rows' outputs, as
decoding does. Prints CPU-ms per step (``time.thread_time``, one torch thread as the engine runs on
CPU) and each against all-greedy. The engine step around it (the model's forward) is not included:
``--engine`` adds a decode step of the tiny model at the same batch, all greedy, mixed, and all greedy
under the serving benchmark's JSON schema (``DIGITS_SCHEMA``: the grammar's bitmask and matchers).

``--baseline REF`` times the ``llm_service`` package of a git revision against the working tree's,
each in a child process, alternating, ``--rounds`` times; the tables give each case's minimum (CPU
time; on a loaded host the minimum is the reading least inflated by other work).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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

Results = dict[str, float]  # "<batch>/<vocab>/<case>" or "<batch>/engine/<case>" -> CPU-ms per step


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


def _time(fn: Callable[[], object], steps: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(steps):
        t = time.thread_time()
        fn()
        samples.append(time.thread_time() - t)
    return statistics.median(samples) * 1e3


def bench(batch: int, vocab: int, steps: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=g)
    shared = torch.Generator().manual_seed(0)  # the engine's default generator: the unseeded rows'
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
    out: dict[str, float] = {}
    for name, (params, grammar) in cases.items():
        gens = [shared if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
        rows = [Row(list(range(i, i + 200)), list(range(i, i + 64))) for i in range(batch)]
        out[name] = _time(_stepper(logits, params, gens, rows, grammar), steps)
    return out


def _stepper(
    logits: torch.Tensor,
    params: list[SamplingParams],
    gens: list[torch.Generator],
    rows: list[Row],
    grammar: GrammarMasks | None,
) -> Callable[[], object]:
    """One decode step's sampling, as the engine calls it (with the state it keeps between steps,
    where this revision has one), its tokens appended to the rows."""
    extra: list[Any] = []
    state_cls = getattr(sampler_module, "SamplerState", None)
    if state_cls is not None:
        extra = [state_cls(), list(range(len(rows)))]

    def step() -> object:
        tokens, _ = sampler_module.sample(logits, params, gens, rows, grammar, *extra)
        for row, t in zip(rows, tokens, strict=True):
            row.output_token_ids.append(t)
        return tokens

    return step


def engine_step_ms(model_dir: str, batch: int, params: list[SamplingParams], steps: int) -> float:
    """CPU-ms of one decode step of ``batch`` requests (the tiny model's forward and the sampler)."""
    from llm_service.config import EngineConfig
    from llm_service.engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=model_dir, max_num_seqs=batch, num_kv_blocks=1024))
    for i, p in enumerate(params):
        eng.add_request(
            f"r{i}",
            [(7 * i + j) % 900 + 20 for j in range(64)],
            replace(p, max_tokens=steps + 8, min_tokens=min(p.min_tokens, steps), ignore_eos=True),
        )
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()  # the prefills
    samples = []
    for _ in range(steps):
        t = time.thread_time()
        eng.step()
        samples.append(time.thread_time() - t)
    return statistics.median(samples) * 1e3


def measure(batches: list[int], vocabs: list[int], steps: int, engine: str | None) -> Results:
    torch.set_num_threads(1)
    res: Results = {}
    for b in batches:
        if engine:
            schema = SamplingParams(structured=StructuredSpec.json_schema(DIGITS_SCHEMA, "response_format"))
            res[f"{b}/engine/all greedy"] = engine_step_ms(engine, b, [SamplingParams()] * b, steps)
            res[f"{b}/engine/mixed"] = engine_step_ms(engine, b, mixed_params(b), steps)
            res[f"{b}/engine/all greedy + schema"] = engine_step_ms(engine, b, [schema] * b, steps)
        for v in vocabs:
            res.update({f"{b}/{v}/{case}": ms for case, ms in bench(b, v, steps).items()})
    return res


def _child(tree: str | None, args: argparse.Namespace) -> Results:
    """``measure`` in a child process, with ``tree``'s ``llm_service`` first on the path (``-P``: not
    the working directory's)."""
    cmd = [sys.executable, "-P", "-m", "cluster.bench.sampler", "--child", "--steps", str(args.steps)]
    cmd += ["--batch", *map(str, args.batch), "--vocab", *map(str, args.vocab)]
    if args.engine:
        cmd += ["--engine", args.engine]
    env = dict(os.environ)
    path = [os.getcwd(), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join([tree, *path] if tree else path)
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return {k: float(v) for k, v in json.loads(out.splitlines()[-1]).items()}


def _baseline_tree(ref: str, into: str) -> str:
    """``ref``'s ``llm_service`` package, extracted under ``into`` (the rest comes from the tree)."""
    archive = subprocess.run(["git", "archive", ref, "llm_service"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def _table(runs: dict[str, list[Results]]) -> list[str]:
    """One row per measured key: each tree's minimum over rounds and its ratio to all-greedy (a key
    one tree did not measure shows as -)."""
    labels = list(runs)
    keys = list(dict.fromkeys(k for rounds in runs.values() for r in rounds for k in r))
    head = "| batch | vocab | case | " + " | ".join(f"{lb} CPU-ms | {lb} x greedy" for lb in labels) + " |"
    lines = [head, "|---:|---:|---|" + "---:|---:|" * len(labels)]
    for key in keys:
        b, v, case = key.split("/", 2)
        cells = []
        for lb in labels:
            got = [r[key] for r in runs[lb] if key in r]
            greedy = [r[f"{b}/{v}/all greedy"] for r in runs[lb] if f"{b}/{v}/all greedy" in r]
            cells.append(f"{min(got):.3f} | {min(got) / min(greedy):.2f}" if got and greedy else "- | -")
        lines.append(f"| {b} | {v} | {case} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cluster.bench.sampler", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[32])
    ap.add_argument("--vocab", type=int, nargs="+", default=[1024, 151936])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument(
        "--engine", help="also time whole decode steps of this model directory (e.g. a tiny model)"
    )
    ap.add_argument("--baseline", help="a git revision whose llm_service to time against the working tree's")
    ap.add_argument("--rounds", type=int, default=3, help="with --baseline: alternating rounds per tree")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.batch, args.vocab, args.steps, args.engine)))
        return 0
    if not args.baseline:
        runs = {"now": [measure(args.batch, args.vocab, args.steps, args.engine)]}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            base = _baseline_tree(args.baseline, tmp)
            runs = {args.baseline: [], "now": []}
            for _ in range(args.rounds):
                runs[args.baseline].append(_child(base, args))
                runs["now"].append(_child(None, args))
    print("\n".join(_table(runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
