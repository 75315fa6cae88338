"""Where a request goes, and whether it may come in: Serve's request routers for the pools
(``request_routers.py``), the prefix-affinity books they keep (``prefix_affinity.py``) and the ingress's
admission control (``admission.py``). It imports no other room of the router."""
