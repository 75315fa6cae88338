"""Runs the targets under libFuzzer (atheris): one in this process, or each in a child and a table.

libFuzzer writes what it finds new to the first corpus folder, so the committed seeds are passed as a
second, read-only one and the working corpus is a temporary folder unless ``--corpus`` names one. A
finding (an exception out of ``one_input``, an input past ``--timeout`` seconds, past ``--rss-mb``)
stops the run and is saved under ``--findings``; ``--reproduce FILE`` runs one input again, no atheris.
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cluster.bench.fuzz import TARGETS, Target

HERE = Path(__file__).resolve().parent
_STATUS = re.compile(r"^#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/", re.M)
_STAT = re.compile(r"^stat::(\w+):\s+(\d+)", re.M)


def seeds_dir(name: str) -> Path:
    return HERE / "corpus" / name


def load_target(target: Target) -> Callable[[bytes], None]:
    module = importlib.import_module(f"cluster.bench.fuzz.{target.name}")
    return module.one_input  # type: ignore[no-any-return]


def fuzz_one(target: Target, seconds: int, corpus: Path, findings: Path, timeout_s: int, rss_mb: int) -> None:
    """Fuzz ``target`` in this process; libFuzzer exits the process when done (0) or on a finding."""
    import atheris

    corpus.mkdir(parents=True, exist_ok=True)
    findings.mkdir(parents=True, exist_ok=True)
    with atheris.instrument_imports(include=[*target.instrument, f"cluster.bench.fuzz.{target.name}"]):
        one_input = load_target(target)
    argv = [
        f"fuzz-{target.name}",
        f"-max_total_time={seconds}",
        f"-timeout={timeout_s}",
        f"-rss_limit_mb={rss_mb}",
        f"-max_len={target.max_len}",
        "-print_final_stats=1",
        f"-artifact_prefix={findings}/",
        str(corpus),
        str(seeds_dir(target.name)),
    ]
    atheris.Setup(argv, one_input)
    atheris.Fuzz()


def reproduce(target: Target, files: list[Path]) -> int:
    """Run ``one_input`` on each file; 1 if any raised (its traceback printed)."""
    one_input, failed = load_target(target), 0
    for f in files:
        try:
            one_input(f.read_bytes())
            print(f"{f}: ok")
        except Exception:
            failed = 1
            print(f"{f}: FINDING")
            traceback.print_exc()
    return failed


@dataclass
class RunResult:
    target: str
    rc: int
    seconds: float
    execs: int = 0
    cov: int = 0
    ft: int = 0
    corpus: int = 0
    log: Path | None = None

    @property
    def verdict(self) -> str:
        return "ok" if self.rc == 0 else f"FINDING (rc {self.rc})"


def parse_log(text: str, result: RunResult) -> RunResult:
    """libFuzzer's last status line (cov, ft, corpus size) and its final stats (executions)."""
    if lines := _STATUS.findall(text):
        execs, cov, ft, corp = (int(x) for x in lines[-1])
        result.execs, result.cov, result.ft, result.corpus = execs, cov, ft, corp
    stats = dict(_STAT.findall(text))
    if "number_of_executed_units" in stats:
        result.execs = int(stats["number_of_executed_units"])
    return result


def run_all(names: list[str], args: argparse.Namespace) -> list[RunResult]:
    """Each target in a child process (libFuzzer runs once per process), its log under ``findings``."""
    results = []
    for name in names:
        log = args.findings / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "cluster.bench.fuzz", "--target", name, "--seconds", str(args.seconds)]
        cmd += [
            "--timeout",
            str(args.timeout),
            "--rss-mb",
            str(args.rss_mb),
            "--findings",
            str(args.findings),
        ]
        if args.corpus is not None:
            cmd += ["--corpus", str(args.corpus / name)]
        print(f"fuzzing {name} for {args.seconds} s ...", flush=True)
        start = time.monotonic()
        with log.open("w") as out:
            rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT)
        result = parse_log(log.read_text(errors="replace"), RunResult(name, rc, time.monotonic() - start))
        result.log = log
        results.append(result)
        print(f"  {result.verdict}: {result.execs} execs, cov {result.cov}, ft {result.ft}", flush=True)
    return results


def table(results: list[RunResult]) -> str:
    rows = [f"{'target':<14}{'seconds':>8}{'execs':>10}{'exec/s':>8}{'cov':>7}{'ft':>7}{'corpus':>8}  result"]
    for r in results:
        rate = r.execs / r.seconds if r.seconds else 0.0
        rows.append(
            f"{r.target:<14}{r.seconds:>8.0f}{r.execs:>10}{rate:>8.0f}{r.cov:>7}{r.ft:>7}{r.corpus:>8}  {r.verdict}"
        )
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cluster.bench.fuzz", description=__doc__)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--target", choices=sorted(TARGETS))
    which.add_argument("--all", action="store_true", help="every target in turn, then a table")
    p.add_argument("--seconds", type=int, default=60, help="libFuzzer's -max_total_time, per target")
    p.add_argument("--corpus", type=Path, help="working corpus (--all: one folder per target under it)")
    p.add_argument("--findings", type=Path, default=Path(tempfile.gettempdir()) / "mmserve-fuzz")
    p.add_argument("--timeout", type=int, default=20, help="seconds one input may take (a hang past it)")
    p.add_argument("--rss-mb", type=int, default=2048, help="memory the process may reach")
    p.add_argument("--reproduce", type=Path, nargs="+", help="run these inputs once, without atheris")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.all:
        results = run_all(list(TARGETS), args)
        print(table(results))
        return 0 if all(r.rc == 0 for r in results) else 1
    target = TARGETS[args.target]
    if args.reproduce:
        return reproduce(target, args.reproduce)
    corpus = args.corpus or Path(tempfile.mkdtemp(prefix=f"mmserve-fuzz-{target.name}-"))
    fuzz_one(target, args.seconds, corpus, args.findings / target.name, args.timeout, args.rss_mb)
    return 0
