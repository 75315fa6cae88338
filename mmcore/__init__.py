"""What every stage shares: one media item's record (``feature.py``) and the one wire codec
(``wire.py``) that every record crossing a process boundary uses. Pure: no torch, no Ray, nothing
of the services (both services and the router import it)."""
