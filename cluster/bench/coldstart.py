"""A replica's cold start: CPU-seconds of its imports and construction, each run in a fresh process.

    python -m cluster.bench.coldstart [--runs 3] [--family qwen2-vl ...] [--replica ingress]  (default: all)

Rows per tiny family (``cluster.tiny_model``) and replica kind:
  ingress   ``router.http.app`` imported, then per model what ``IngressServer`` builds: its tokenizer
            (``chat_tokenizer``, loaded once) and the hit path's preparer over it (``app._hit_path``:
            ``make_preparer(tokenizer=)``, the model's ``HitPathFacts``, no HF processor)
  encoder   ``EncoderServer`` (the tower, on CPU) and its ``Preprocessor`` (the HF processor)
CPU time is ``time.process_time()`` of the child (all its threads): the figure that moves least when
other processes share the machine; the table gives the minimum over ``--runs``. ``heavy`` lists the
costly packages the child ended up importing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

KINDS = ("ingress", "encoder")
HEAVY = ("torch", "torchvision", "torch._dynamo", "triton", "sympy", "scipy", "ray.serve", "fastapi")

_CHILD = """
import json, sys, time
kind, model_dir = sys.argv[1], sys.argv[2]
t0 = time.process_time()
if kind == "ingress":
    import router.http.app as app
    from encoder_service.preprocess.make_preparer import make_preparer
    from encoder_service.preprocess.media import MediaLimits
    t1 = time.process_time()
    tokenizer = app.chat_tokenizer(model_dir, None)
    make_preparer(model_dir, limits=MediaLimits(), limit_mm_per_prompt={}, processor_cache_bytes=0,
                  cache=None, encode=None, tokenizer=tokenizer)
else:
    from encoder_service.preprocess.processing import Preprocessor
    from encoder_service.serve.deployment import EncoderServer
    t1 = time.process_time()
    EncoderServer(model_dir, device="cpu")
    Preprocessor(model_dir)
t2 = time.process_time()
heavy = [m for m in json.loads(sys.argv[3]) if m in sys.modules]
print(json.dumps({"import_s": t1 - t0, "build_s": t2 - t1, "heavy": heavy}))
"""


def one_start(kind: str, model_dir: Path) -> dict[str, object]:
    """One replica kind's imports and construction in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, kind, str(model_dir), json.dumps(HEAVY)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--family", action="append", help="cluster.tiny_model family (repeatable)")
    p.add_argument(
        "--replica", action="append", choices=KINDS, help="replica kind (repeatable; default: both)"
    )
    args = p.parse_args()
    from cluster.tiny_model import make_tiny_model
    from encoder_service.families import FAMILY_NAMES

    families = args.family or list(FAMILY_NAMES)
    with tempfile.TemporaryDirectory() as root:
        print(f"{'family':<12} {'replica':<8} {'import CPU-s':>12} {'build CPU-s':>11} {'total':>6}  heavy")
        for family in families:
            model_dir = make_tiny_model(Path(root) / family, family)
            for kind in args.replica or KINDS:
                runs = [one_start(kind, model_dir) for _ in range(args.runs)]
                best = min(runs, key=lambda r: float(r["import_s"]) + float(r["build_s"]))  # type: ignore[arg-type]
                imp, build = float(best["import_s"]), float(best["build_s"])  # type: ignore[arg-type]
                heavy = ",".join(best["heavy"])  # type: ignore[arg-type]
                print(f"{family:<12} {kind:<8} {imp:>12.2f} {build:>11.2f} {imp + build:>6.2f}  {heavy}")


if __name__ == "__main__":
    main()
