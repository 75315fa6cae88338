"""The head's GCS killed and restarted under load with GCS fault tolerance (``cluster/bench/chaos_head.py``:
a local ``redis-server``, ``ray start --head`` with ``RAY_REDIS_ADDRESS``, a worker node with the pools,
``serve deploy`` of the shipped CPU config): no request is lost or fails uncoded, the app is RUNNING
again, and no encoder-cache reservation is left."""

from __future__ import annotations

import shutil

import pytest

from cluster.bench import chaos_head

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.skipif(
        shutil.which("redis-server") is None, reason="needs redis-server (make chaos installs it)"
    ),
]


def test_requests_survive_a_gcs_restart() -> None:
    result = chaos_head.run(chaos_head.parse_args([]))
    print("\n" + result.text)
    r = result.report
    assert r.sent == 64
    assert r.counts["uncoded"] == 0 and r.counts["lost"] == 0, r.notes
    assert result.running_after_restart_s is not None, "the app never showed RUNNING after the restart"
    assert r.leak_count == 0, r.leaks
