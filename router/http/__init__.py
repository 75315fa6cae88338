"""The HTTP edge: the FastAPI app and the ingress replica class (``app.py``), the chat-completions route's
work (``chat.py``: parse, admit, run the journey, render), the direct listener (``listener.py``), SSE,
API keys (``auth.py``), JSON limits, the ingress's metrics, request spans and the replay log of failed
requests. The top room: it may import the journey, the routing and the protocol rooms."""
