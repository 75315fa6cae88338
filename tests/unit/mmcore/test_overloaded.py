"""Every pool's full queue refuses with one shape (mmcore.errors.Overloaded): the same 503 at the edge,
whichever pool raised it, after Ray's pickling."""

from __future__ import annotations

import pickle

import pytest

from encoder_service.encode.encoder_queue import EncoderOverloaded
from llm_service.scheduler import WaitingQueueFull
from mmcore.errors import Overloaded
from mmcore.link.frames import LinkBusy
from router.protocol.errors import from_exception


@pytest.mark.parametrize("cls", [EncoderOverloaded, WaitingQueueFull, LinkBusy])
def test_one_overload_shape(cls: type[Overloaded]) -> None:
    err = pickle.loads(pickle.dumps(cls("the queue is full")))
    assert isinstance(err, Overloaded) and str(err) == "the queue is full"
    api = from_exception(err)
    assert api is not None and (api.status_code, api.code) == (503, "overloaded")
    assert api.headers() == {"Retry-After": "1"} and api.message == "the queue is full"
