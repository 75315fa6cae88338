"""``mmserve serve --pool-engine ROLE.KEY=VALUE``: an E/P/D pool's own engine setting
(``llm.pools[role].engine.KEY``, cluster/pool_config.py's ``LLMPoolEngine``) from the command line,
for every model, e.g. ``--pd --pool-engine prefill.max_num_batched_tokens=2048 --pool-engine
decode.num_kv_blocks=4096``. Refused, naming the flag: an unknown role or key, a setting both pools
must share (set under ``llm``: ``--dtype``, ``--max-model-len``, ...), a value that is no number, and
a model with no such pool (neither ``--pd`` nor ``llm.pools`` in its config)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping

from cluster.pool_config import POOL_SHARED_FIELDS, LLMPoolEngine

POOL_ROLES = ("prefill", "decode")


def add_pool_engine_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pool-engine",
        action="append",
        default=None,
        metavar="ROLE.KEY=VALUE",
        help="E/P/D (with --pd or a config's llm.pools): one pool's own engine setting over the model's "
        f"llm ones, for every model; ROLE: prefill, decode; KEY: {', '.join(LLMPoolEngine.model_fields)}; "
        "e.g. prefill.max_num_batched_tokens=2048; repeatable",
    )


def parse_pool_engine(flag: str) -> tuple[str, str, int | float]:
    """``ROLE.KEY=VALUE`` → (role, key, value); ``SystemExit`` naming what is wrong."""
    target, sep, raw = flag.partition("=")
    role, dot, key = target.partition(".")
    if not sep or not dot:
        raise SystemExit(f"--pool-engine {flag!r}: ROLE.KEY=VALUE, e.g. prefill.max_num_batched_tokens=2048")
    if role not in POOL_ROLES:
        raise SystemExit(f"--pool-engine {flag!r}: ROLE is one of {', '.join(POOL_ROLES)}, not {role!r}")
    if key in POOL_SHARED_FIELDS:
        raise SystemExit(
            f"--pool-engine {flag!r}: {key} must be the same in the prefill and decode pools (the KV "
            "moves between them): set it for the model's llm (e.g. --dtype, --max-model-len)"
        )
    if key not in LLMPoolEngine.model_fields:
        raise SystemExit(
            f"--pool-engine {flag!r}: unknown key {key!r}; a pool sets {', '.join(LLMPoolEngine.model_fields)}"
        )
    try:
        value: int | float = int(raw)
    except ValueError:
        try:
            value = float(raw)
        except ValueError:
            raise SystemExit(f"--pool-engine {flag!r}: VALUE is a number, not {raw!r}") from None
    return role, key, value


def apply_pool_engine(data: Mapping[str, object], flags: Iterable[str]) -> None:
    """Write each flag's setting into every model's pool of that role in ``data`` (a config's dump, its
    pools already there: ``--pd`` or the config's). The values are checked with the config
    (``LLMPoolEngine``'s bounds, a decode pool's own settings), which names the model and field."""
    for flag in flags:
        role, key, value = parse_pool_engine(flag)
        for m in data["models"]:  # type: ignore[attr-defined]
            pools = [p for p in m["llm"]["pools"] if p["role"] == role]
            if not pools:
                raise SystemExit(
                    f"--pool-engine {flag!r}: model {m['name']!r} is not deployed as E/P/D (no {role} "
                    "pool): add --pd, or give it llm.pools in its config"
                )
            engine = pools[0].get("engine") or {}
            engine[key] = value
            pools[0]["engine"] = engine
