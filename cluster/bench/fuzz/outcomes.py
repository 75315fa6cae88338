"""What counts as a finding, shared by the targets.

A target returns when the server would answer: a parsed value, or the rejection it maps to a 4xx.
Any other exception propagates (libFuzzer reports it and saves the input). One more case is a finding
although the server answers 4xx: the media decoders map *every* exception a third-party decoder raises
to a 422 (``errors.decoding``), which would also hide a bug of our own. So a 4xx whose cause is a
programming error (``TypeError``, ``KeyError``, ...) raised in mmserve's own code is re-raised.
"""

from __future__ import annotations

import traceback
from pathlib import Path

# the exceptions that say "the code is wrong", not "the bytes are"
PROGRAMMING_ERRORS: tuple[type[BaseException], ...] = (
    AssertionError,
    AttributeError,
    IndexError,
    KeyError,
    NameError,
    RecursionError,
    TypeError,
    ZeroDivisionError,
)
_REPO = Path(__file__).resolve().parents[3]
_OUR_PACKAGES = tuple(str(_REPO / p) + "/" for p in ("router", "encoder_service", "llm_service", "mmcore"))


class HiddenBug(Exception):
    """A 4xx answer whose cause is a programming error in our own code."""


def raised_in_our_code(exc: BaseException) -> bool:
    """The innermost frame of ``exc``'s traceback is in one of mmserve's packages."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_OUR_PACKAGES)


def check_cause(rejection: BaseException) -> None:
    """Re-raise (as ``HiddenBug``) a rejection that wraps a programming error raised in our code."""
    cause = rejection.__cause__
    if isinstance(cause, PROGRAMMING_ERRORS) and raised_in_our_code(cause):
        raise HiddenBug(f"{type(rejection).__name__} hides {type(cause).__name__}: {cause}") from cause
