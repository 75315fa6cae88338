"""What the link takes from Ray: the cluster's keys (in Ray's internal KV) and the in-band pickle that
carries ObjectRefs in the frames. The wiring injects both (cluster/replica_links.py); the rest of the
package knows no Ray.

The link's keys (``LinkKeys``: CURVE key pairs for the servers and the clients) live in Ray's internal KV
(the GCS), created once per cluster by whichever process asks first: whoever can read them can run code
on the cluster anyway. ``MMSERVE_LINK_ENCRYPT=0`` in that process's environment (set it where
``ray start`` runs) makes them PLAIN keys: authenticated, not encrypted.
"""

from __future__ import annotations

import os

from mmcore.link.frames import LinkKeys

_KEYS_KEY = b"mmserve-direct-link-keys"


def link_keys() -> LinkKeys:
    """The cluster's direct-link keys (created on first use; ``MMSERVE_LINK_ENCRYPT=0``: unencrypted)."""
    from ray.experimental import internal_kv

    encrypt = os.environ.get("MMSERVE_LINK_ENCRYPT", "1") not in ("0", "false", "no")
    internal_kv._internal_kv_put(_KEYS_KEY, LinkKeys.generate(encrypt).to_bytes(), overwrite=False)
    raw = internal_kv._internal_kv_get(_KEYS_KEY)
    assert raw is not None
    return LinkKeys.from_bytes(bytes(raw))


def frame_dumps(obj: object) -> bytes:
    """``ray.cloudpickle.dumps`` as Ray pickles a task's arguments ("in band"): each ObjectRef is
    written with its owner's address, and not pinned. Out of band (a bare ``cloudpickle.dumps``) Ray
    pins every ref it writes for the life of the process: 496 references left in the ingress after
    the 500-request leak test. The object stays alive while its owner holds it, as in Serve's own
    gRPC transport (README, "No pins")."""
    import ray
    from ray import cloudpickle

    ctx = ray._private.worker.global_worker.get_serialization_context()
    if ctx.is_in_band_serialization():  # inside another serialisation: leave its books alone
        return bytes(cloudpickle.dumps(obj))
    ctx.set_in_band_serialization()
    try:
        return bytes(cloudpickle.dumps(obj))
    finally:
        ctx.set_out_of_band_serialization()
        ctx.get_and_clear_contained_object_refs()
