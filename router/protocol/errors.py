"""Errors the API returns, in OpenAI's JSON shape, and the mapping from each service's exceptions."""

from __future__ import annotations

from typing import TypeVar

from router.protocol.openai import ErrorBody, error_body

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error with an HTTP status that the ingress returns as ``{"error": {...}}``."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> ErrorBody:
        type_ = _TYPE_BY_STATUS.get(self.status_code, "server_error")
        return error_body(self.message, type_=type_, code=self.code, param=self.param)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


E = TypeVar("E", bound=BaseException)


def find_cause(exc: BaseException | None, cls: type[E], attr: str) -> E | None:
    """The first ``cls`` in ``exc``'s chain (Ray's RayTaskError ``cause``, then ``__cause__``) that
    carries ``attr``: Ray's dual-class wrappers pass ``isinstance`` without holding the fields."""
    for _ in range(5):
        if exc is None:
            return None
        if isinstance(exc, cls) and attr in vars(exc):
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__
    return None


def bad_request(message: str, *, code: str = "invalid_request", param: str | None = None) -> APIError:
    return APIError(400, message, code=code, param=param)


def from_exception(exc: BaseException) -> APIError | None:
    """Map a service exception (possibly wrapped by Ray) to an APIError; None if it is our own fault.

    Services raise exceptions that carry ``status_code`` and ``code`` (encoder_service's MediaError)
    or ``code`` alone (llm_service's RequestRejected, a 400). Ray wraps remote exceptions in
    RayTaskError whose ``cause`` is the original.
    """
    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, APIError):
            return exc
        infra = _infrastructure_error(exc)
        if infra is not None:
            return infra
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):  # a RayTaskError (its dual class has the cause's `code`,
            exc, seen = cause, seen + 1  # but its text is the remote traceback): the original's own text
            continue
        status = getattr(exc, "status_code", None)
        code = getattr(exc, "code", None)
        if isinstance(status, int) and isinstance(code, str) and 400 <= status < 600:
            retry = getattr(exc, "retry_after_s", None) or (1 if status == 503 else None)
            return APIError(status, str(exc), code=code, retry_after_s=retry)
        if isinstance(code, str) and isinstance(exc, ValueError):
            param = getattr(exc, "param", None)
            return APIError(400, str(exc), code=code, param=param if isinstance(param, str) else None)
        cause = getattr(exc, "cause", None) or exc.__cause__
        exc = cause  # type: ignore[assignment]
        seen += 1
    return None


# Ray and Serve failures a client can retry, matched by class name anywhere in the MRO (Ray's
# RayTaskError dual classes subclass the cause's class): no Ray import here.
_BACKPRESSURE = {"BackPressureError", "RayServeBackPressureError"}
_REPLICA_LOST = {
    "ActorDiedError",
    "ActorUnavailableError",
    "RayActorError",
    "NodeDiedError",
    "WorkerCrashedError",
}


def _infrastructure_error(exc: BaseException) -> APIError | None:
    names = {c.__name__ for c in type(exc).__mro__}
    if names & _BACKPRESSURE:
        return APIError(
            503,
            "the server is at capacity (a pool's queue is full); retry later",
            code="overloaded",
            retry_after_s=1,
        )
    if names & _REPLICA_LOST:
        return APIError(
            503,
            f"a replica serving this request died ({type(exc).__name__}); retry shortly",
            code="replica_lost",
            retry_after_s=1,
        )
    return None


def is_client_error(e: BaseException) -> bool:
    """The error maps to a 4xx: the request's fault, not the system's."""
    api = from_exception(e)
    return api is not None and api.status_code < 500


def lost_twice(mm_hashes: list[str]) -> APIError:
    """A request whose embeddings were lost again after being encoded once more: a 503 to retry."""
    return APIError(
        503,
        f"the embeddings of {len(mm_hashes)} media item(s) were lost twice while serving this request "
        "(encoder replicas are restarting or scaling down); retry shortly",
        code="embeddings_lost",
        retry_after_s=1,
    )


def replica_gone(e: BaseException) -> bool:
    """The call's replica died (Ray actor errors, matched by name: Ray stays out of the router's logic)."""
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"ActorDiedError", "ActorUnavailableError", "RayActorError", "LinkLost"})
