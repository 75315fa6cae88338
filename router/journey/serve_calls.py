"""What the router calls on a Serve deployment, as protocols: in production Ray Serve's
``DeploymentHandle`` (its method attributes, ``.remote(...)`` and ``.options(stream=True)``), in the
unit tests in-process fakes. Each pool's own protocol (``router/journey/model_handles.py``,
``router/journey/llm_client.py``) names its methods with these and the types they answer."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Protocol, TypeVar

T_co = TypeVar("T_co", covariant=True)

Counters = Mapping[str, object]  # a replica's ``stats`` answer (JSON-shaped counters)


class StreamCall(Protocol[T_co]):
    """A streaming call in flight (Serve's ``DeploymentResponseGenerator``): its items in order;
    ``cancel`` stops it on the replica."""

    def __aiter__(self) -> AsyncIterator[T_co]: ...

    def __anext__(self) -> Awaitable[T_co]: ...

    def cancel(self) -> None: ...


class UnaryMethod(Protocol[T_co]):
    """A replica method called for one answer: ``await pool.method.remote(*args)``."""

    def remote(self, *args: object) -> Awaitable[T_co]: ...


class StreamingMethod(Protocol[T_co]):
    """A replica method called as a stream (on ``pool.options(stream=True)``)."""

    def remote(self, *args: object) -> StreamCall[T_co]: ...
