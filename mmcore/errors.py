"""The one overload error every pool raises: a full queue refuses a request at once, with a 503 and
Retry-After, rather than letting it wait past any deadline. The router maps any exception with this
shape (``status_code``, ``code``, ``retry_after_s``) to its HTTP answer, across Ray's pickling."""

from __future__ import annotations


class Overloaded(RuntimeError):
    """A queue is at its bound: the client gets 503 ``overloaded`` with Retry-After at once."""

    status_code = 503
    code = "overloaded"
    retry_after_s = 1

    def __reduce__(self):  # type: ignore[no-untyped-def]  # keeps the message across pickling (Ray)
        return (type(self), self.args)


class StillHeld(Overloaded):
    """A request sent again (its ingress lost the link to the replica running it) reached the replica
    that still runs the earlier attempt, before that replica saw the link go and aborted it: a 503 to
    retry once it has, not a duplicate."""

    code = "request_still_held"
