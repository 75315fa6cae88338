"""The ``mmserve`` command line: ``make-tiny-model``, ``serve``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from cluster.tiny_model import FAMILIES, PRESETS, TINY_RECIPES, ModelSize, make_tiny_model


def _add_make_tiny_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny-model", help="write a deterministic random-weight HF model directory")
    p.add_argument("dir", help="output directory")
    p.add_argument("--family", choices=FAMILIES, required=True)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    variants = "; ".join(
        f"{r.name}: {', '.join(r.variants[1:])}" for r in TINY_RECIPES.values() if r.variants[1:]
    )
    p.add_argument("--variant", default="base", help=f"a family's alternative recipe ({variants})")
    for field in dataclasses.fields(ModelSize):
        p.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=None)
    p.set_defaults(func=_cmd_make_tiny_model)


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(ModelSize)
        if getattr(args, f.name) is not None
    }
    size = dataclasses.replace(PRESETS[args.preset], **overrides)
    out = make_tiny_model(args.dir, args.family, size, args.variant)
    print(f"wrote {args.family} ({args.preset}) to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_tiny_model(sub)
    try:
        from cluster.serve_cli import add_serve_command
    except ImportError:  # pragma: no cover - serve lands with the router
        pass
    else:
        add_serve_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
