"""What every stage shares: one media item's record (``feature.py``), the one wire codec (``wire.py``)
that every record crossing a process boundary uses, and the transport between pools (``link/``). Pure
but for the link's Ray glue (``link/on_ray.py``): no torch, nothing of the services (both services and
the router import it)."""
