"""The fuzz targets (cluster/bench/fuzz) without atheris: each ``one_input`` over its seed corpus and a
few hundred seeded mutations of it (bytes flipped, inserted, deleted, cut, spliced, random). CI's
"seconds" of fuzzing; ``make fuzz`` runs the coverage-guided minutes."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.bench.fuzz import TARGETS
from cluster.bench.fuzz.runner import load_target, seeds_dir

MUTATIONS = {"video": 300, "audio": 300}  # the decoders are the slow ones; the rest get DEFAULT
DEFAULT = 500
INTERESTING = (b"\x00", b"\xff", b"\x7f", b"\x80", b'"', b"[", b"{", b"\\", b"-1", b"9" * 20, b"\xed\xa0\x80")


def seeds(name: str) -> list[bytes]:
    return [f.read_bytes() for f in sorted(seeds_dir(name).iterdir())]


def mutate(rng: random.Random, data: bytes, others: list[bytes]) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(len(out) + 1)
        op = rng.randrange(6)
        if op == 0 and out:
            out[min(i, len(out) - 1)] = rng.randrange(256)
        elif op == 1:
            out[i:i] = rng.choice(INTERESTING)
        elif op == 2:
            del out[i : i + rng.randint(1, 64)]
        elif op == 3:
            del out[i:]
        elif op == 4:
            other = rng.choice(others)
            j = rng.randrange(len(other) + 1)
            out[i:i] = other[j : j + rng.randint(1, 256)]
        else:
            out[i:i] = rng.randbytes(rng.randint(1, 16))
    return bytes(out)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_target_has_small_seeds(name: str) -> None:
    files = list(seeds_dir(name).iterdir())
    assert len(files) >= 5
    assert all(f.stat().st_size < 20 * 1024 for f in files)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_seeds_and_mutations_are_parsed_or_rejected(name: str) -> None:
    one_input = load_target(TARGETS[name])
    corpus = seeds(name)
    for data in corpus:
        one_input(data)
    rng = random.Random(f"fuzz-{name}")
    for k in range(MUTATIONS.get(name, DEFAULT)):
        data = rng.randbytes(rng.randint(0, 64)) if k % 10 == 9 else mutate(rng, rng.choice(corpus), corpus)
        try:
            one_input(data[: TARGETS[name].max_len])
        except Exception as e:
            raise AssertionError(f"{name}: input {k} {data[:200]!r}... raised {e!r}") from e


def test_the_targets_import_no_ray() -> None:
    code = (
        "import sys\nfrom cluster.bench.fuzz import TARGETS\nfrom cluster.bench.fuzz.runner import load_target\n"
        "for t in TARGETS.values(): load_target(t)\nassert 'ray' not in sys.modules, 'ray imported'\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[4], timeout=60
    )
