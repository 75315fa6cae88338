"""Errors for bad requests (the router maps them to 4xx) and for one request's failed computation."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request the engine can never serve.

    ``code`` is one of ``prompt_too_long``, ``too_many_blocks``, ``bad_sampling_params``,
    ``bad_mm_input``, ``bad_prompt``, ``duplicate_request_id``, ``bad_structured_output``; the
    message names the problem, ``param`` (when known) the request field at fault.
    """

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    def __reduce__(self):  # type: ignore[no-untyped-def]  # keeps ``code`` across pickling (Ray)
        return (type(self), (self.code, self.message, self.param))


class RequestFailed(Exception):
    """One request's computation failed inside an engine step (the others in the step went on).

    The engine finishes such a request with ``finish_reason="error"`` and ``RequestOutput.error``;
    the serving loop raises this to that request's caller only. A 500: the request was admitted as
    valid, so the fault is the server's (e.g. the model produced non-finite logits for its inputs).
    """

    status_code = 500
    code = "request_failed"

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id!r} failed in the engine: {message}")
        self.request_id = request_id
        self.message = message

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (self.request_id, self.message))


class RequestFaults(RuntimeError):
    """Raised inside a step when the failing requests are known (e.g. the sampler found non-finite
    logits in their rows): ``faults`` maps each culprit's request id to what went wrong."""

    def __init__(self, faults: dict[str, str]) -> None:
        super().__init__("; ".join(f"{rid}: {msg}" for rid, msg in faults.items()))
        self.faults = faults
