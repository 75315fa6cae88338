"""Errors for bad requests; the router maps them to 4xx responses."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request the engine can never serve.

    ``code`` is one of ``prompt_too_long``, ``too_many_blocks``, ``bad_sampling_params``,
    ``bad_mm_input``, ``bad_prompt``, ``duplicate_request_id``; the message names the problem.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __reduce__(self):  # type: ignore[no-untyped-def]  # keeps ``code`` across pickling (Ray)
        return (type(self), (self.code, self.message))
