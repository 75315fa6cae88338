"""The transport: direct links between a caller and the replicas of a pool (ZeroMQ, authenticated).

    direct_link.py  the design (read it first) and ``DirectLink``: calls to one replica, reconnecting
    client.py       the caller's end (DEALER socket, monitor, deadlines)
    server.py       the replica's end (ROUTER socket, ZAP authenticator, bounds)
    frames.py       the wire both ends share: limits, errors, keys, multipart send/receive
    pool_links.py   ``PoolLinks``: calls to any replica of a pool, routed by the pool's Serve router
    on_ray.py       what the wiring injects from Ray: the cluster's keys, the in-band pickle of ObjectRefs

It knows no service, no router and no wiring (an import-linter contract): cluster/replica_links.py
gives the replicas their servers and the callers their links.
"""
