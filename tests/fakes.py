"""Small stand-ins shared by unit tests: a ``.remote`` shim over an in-process object, a settable clock."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class Remote:
    """``handle.method.remote(...)`` -> the method's coroutine, as awaiting a Ray ref would give."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> Any:
        return SimpleNamespace(remote=getattr(self._obj, name))


class Clock:
    """A clock the test moves by hand (``clock.now = 31.0``)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
