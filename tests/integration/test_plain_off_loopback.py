"""A replica whose cluster keys are PLAIN refuses to start on a node address (a unit of the link's
address check that needs Ray's node-address lookup, hence here; nothing binds or connects)."""

from __future__ import annotations

import pytest

from mmcore.link.frames import LinkKeys, PlainOffLoopback


def test_a_replica_with_plain_keys_on_a_node_address_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray

    from cluster import replica_links

    plain = LinkKeys.generate(encrypt=False)
    monkeypatch.setattr(replica_links, "link_keys", lambda: plain)
    served = replica_links.DirectLLM()
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.5")  # never bound: refused first
    with pytest.raises(PlainOffLoopback, match="MMSERVE_LINK_ENCRYPT"):
        served.refuse_plain_off_loopback()
    served.links_on = False  # ingress.transport: serve: no listener, nothing to refuse
    served.refuse_plain_off_loopback()
    served.links_on = True
    monkeypatch.setattr(
        ray.util, "get_node_ip_address", lambda: "127.0.0.1"
    )  # `mmserve serve`'s embedded Ray
    served.refuse_plain_off_loopback()
