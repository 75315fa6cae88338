"""``mmserve serve``'s graceful stop: SIGTERM and SIGINT raise ``Stop`` in the driver (held from Ray's
processes while ``ray.init`` starts them), then ``drain`` deletes the app replica by replica, letting
the requests in flight finish, and shuts Serve and Ray down."""

from __future__ import annotations

import signal
import sys
from types import FrameType


class Stop(Exception):
    """SIGTERM or SIGINT arrived: drain and exit."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise Stop(signal.Signals(signum).name)


def take_signals() -> None:
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)


def hold_sigterm_for_ray() -> None:
    """Block SIGTERM in this thread while ``ray.init`` starts Ray's processes: each inherits the
    blocked signal (the mask survives fork and exec) and passes it on to what it starts, Serve's
    replicas included, so a SIGTERM sent to every process at once (``kill -TERM -PGID``, systemd's
    ``KillMode=control-group``) reaches only this driver, which drains and then stops them. Ray does
    the same with SIGINT for Ctrl-C. Ray's own stop (``ray.shutdown``) sends SIGTERM, waits 1 s,
    then SIGKILLs: that second is what the held signal costs each of its processes."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def ray_started() -> None:
    """Ray is up: take SIGTERM back from the handlers ``ray.init`` installed (Python's sys.exit, the
    core worker's stack dump and abort) and unblock it here; one that arrived meanwhile raises now."""
    take_signals()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def drain() -> int:
    """Stop taking requests, let those in flight finish, shut Serve and Ray down: 0 on success.

    Deleting the app is graceful: each replica stops taking calls and gets its pool's
    ``graceful_shutdown_timeout_s`` for the ones in flight (the LLM replica's open submit calls are its
    requests, the encoder's encode calls its FIFO), then its ``__del__``: the ingress closes admission
    and its direct HTTP server (no new connections, responses in flight finish), the encoder drains its
    FIFO and drops the cache entries it owns. A second signal while draining is ignored.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = 0
    try:
        import ray
        from ray import serve

        if ray.is_initialized():
            for name in list(serve.status().applications):
                serve.delete(name)  # blocks until every replica finished (or timed out) and exited
            serve.shutdown()
            ray.shutdown()
    except Exception as e:  # a failed drain is still an exit, but not a clean one
        print(f"mmserve: shutdown failed: {e!r}", file=sys.stderr, flush=True)
        code = 1
    print("mmserve: stopped", flush=True)
    return code
